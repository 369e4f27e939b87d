"""Two planners at once: two control-plane processes run the watermark beat job in a tight loop
against the same database while a real node executes what they plan and new blocks keep
arriving. No block ever has two movements in flight, no copy is moved twice, and afterwards
I1-I4 hold and every block reads back with its own bytes."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections import defaultdict

import pytest
from django.db import connection

from controlplane.movements.choices import IN_FLIGHT, MovementState
from controlplane.movements.models import Movement
from controlplane.policies.models import TierPolicy
from controlplane.policies.services import tierpolicy_create, tierpolicy_update
from tests.movements.procs import REPO_ROOT, reconcile_and_check, served_bytes_check, write_blocks
from tests.support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

PLANNER_SECONDS = 20

_PLANNER_LOOP = f"""
import time
from controlplane.movements.tasks import movements_plan_watermarks_task
deadline = time.monotonic() + {PLANNER_SECONDS}
runs = 0
while time.monotonic() < deadline:
    movements_plan_watermarks_task()
    runs += 1
    time.sleep(0.02)
print(f"planner finished: {{runs}} runs of the watermark job")
"""

_DOUBLE_IN_FLIGHT = (
    "SELECT block_id FROM movements_movement WHERE state = ANY(%s) GROUP BY block_id HAVING count(*) > 1"
)


def _double_in_flight() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(_DOUBLE_IN_FLIGHT, [[s.value for s in IN_FLIGHT]])
        return [row[0] for row in cursor.fetchall()]


def _draining_node(node_factory):  # type: ignore[no-untyped-def]
    """A real node whose every host block is over the host policy's capacity (so each one leaves
    for disk), and this test's own view of its tiers."""
    drain = {"capacity_bytes": 1, "high_watermark": 0.9, "low_watermark": 0.5}
    existing = TierPolicy.objects.filter(tier="host", node_group="").first()
    if existing is None:
        tierpolicy_create(tier="host", comment="drain host", **drain)
    else:
        tierpolicy_update(policy=existing, comment="drain host", **drain)
    nodes = node_factory(tiers="device,host,disk")
    process, _ = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    return nodes, store, profile


def _feed(store, profile, nodes, seeds: dict, *, seconds: float, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    """New blocks keep arriving for `seconds` while the planners run; returns every block seen
    with two movements in flight (checked every 0.1 s)."""
    seen_double: list[int] = []
    deadline = time.monotonic() + seconds
    batch = 0
    while time.monotonic() < deadline:
        batch += 1
        seeds.update(write_blocks(store, profile, nodes.name, 2, seed=seed + 10 * batch, wait_heartbeat=False))
        for _ in range(5):
            seen_double += _double_in_flight()
            time.sleep(0.1)
    return seen_double


def _movements_by_block() -> tuple[list[Movement], dict[int, list[Movement]]]:
    movements = list(Movement.objects.order_by("block_id", "started_at"))
    by_block: dict[int, list[Movement]] = defaultdict(list)
    for m in movements:
        by_block[m.block_id].append(m)
    return movements, by_block


def test_two_planner_processes_at_once_never_move_a_block_twice(node_factory, subprocess_env, python, tmp_path):
    nodes, store, profile = _draining_node(node_factory)
    planners: list[tuple[subprocess.Popen, object]] = []
    try:
        seeds = write_blocks(store, profile, nodes.name, 4)
        for i in range(2):
            out = open(tmp_path / f"planner-{i}.log", "w+")
            planners.append(
                (
                    subprocess.Popen(
                        [python, "manage.py", "shell", "-c", _PLANNER_LOOP],
                        cwd=REPO_ROOT,
                        env=subprocess_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                )
            )
        seen_double = _feed(store, profile, nodes, seeds, seconds=PLANNER_SECONDS - 4, seed=1000)
        for planner, out in planners:
            assert planner.wait(PLANNER_SECONDS + 60) == 0
            out.seek(0)  # type: ignore[attr-defined]
            text = out.read()  # type: ignore[attr-defined]
            print(text[-2000:])
            assert "planner finished" in text
        wait_for(
            lambda: not Movement.objects.filter(state__in=IN_FLIGHT).exists(),
            timeout=90,
            what="the node to finish every planned move",
        )

        assert seen_double == []
        movements, by_block = _movements_by_block()
        assert len({m.plan for m in movements}) >= 2, "the planners wrote more than one plan"
        for block_id, moves in by_block.items():
            done = [m for m in moves if m.state == MovementState.DONE]
            assert len(done) == 1, (block_id, [(m.id, m.state, m.src_tier, m.detail) for m in moves])
            for earlier, later in zip(moves, moves[1:], strict=False):
                assert earlier.finished_at <= later.started_at, f"block {block_id} had overlapping movements"
        # A duplicate that slipped through would be refused on the node (cancelled): none was planned.
        assert not [m for m in movements if m.state != MovementState.DONE], [
            (m.id, m.state, m.detail) for m in movements if m.state != MovementState.DONE
        ]
        assert len(by_block) == len(seeds)
        assert served_bytes_check(store, seeds) == {"served": len(seeds), "missed": 0}
        reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    finally:
        for planner, out in planners:
            if planner.poll() is None:
                planner.kill()
                planner.wait(10)
            out.close()  # type: ignore[attr-defined]
        store.close()


def _stop_beat(daemon: subprocess.Popen) -> None:
    """SIGTERM a `celery beat`, again if it goes on. Celery's handler raises SystemExit wherever
    the signal lands; landing inside a broker round trip, redis-py's cleanup replaces it with an
    I/O error that beat logs as a failed send and carries on (seen in CI: the beat sent the job
    for 30 s after its SIGTERM). A supervisor escalates; this sends the signal again."""
    for _attempt in range(3):
        daemon.terminate()
        try:
            daemon.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue
    daemon.kill()
    daemon.wait(10)


def test_two_beat_daemons_at_once_never_move_a_block_twice(node_factory, subprocess_env, python, tmp_path):
    """The deployment mistake itself: two real `celery beat` processes on the same schedule (the
    database scheduler), both sending the watermark job every second to a real control worker
    that runs two plans at a time, while a real node executes the moves."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    queue = f"control-beat-test-{uuid.uuid4().hex[:8]}"  # this test's own control queue
    every_second, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.exclude(task="movements.plan_watermarks").update(enabled=False)
    # (Created when an earlier transactional test has flushed the rows the migration wrote.)
    PeriodicTask.objects.update_or_create(
        name="movements: plan over watermark",
        defaults={"task": "movements.plan_watermarks", "interval": every_second, "queue": queue, "enabled": True},
    )
    nodes, store, profile = _draining_node(node_factory)
    celery = [python, "-m", "celery", "-A", "controlplane.celery_app"]
    daemons: list[tuple[subprocess.Popen, object]] = []
    try:
        seeds = write_blocks(store, profile, nodes.name, 4)
        commands = [
            celery
            + [
                "worker",
                "-Q",
                queue,
                "-n",
                f"{queue}@%h",
                "--pool",
                "threads",
                "--concurrency",
                "2",
                "--without-gossip",
                "--without-mingle",
                "--loglevel",
                "INFO",
            ]
        ]
        commands += [
            celery + ["beat", "--loglevel", "INFO", f"--pidfile={tmp_path / f'beat-{i}.pid'}", "--max-interval", "1"]
            for i in range(2)
        ]
        beat_env = {**subprocess_env, "DJANGO_SETTINGS_MODULE": "tests.movements.beat_settings"}
        for i, command in enumerate(commands):
            out = open(tmp_path / f"daemon-{i}.log", "w+")
            daemons.append(
                (
                    subprocess.Popen(
                        command,
                        cwd=REPO_ROOT,
                        env=beat_env if i else subprocess_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                )
            )
        seen_double = _feed(store, profile, nodes, seeds, seconds=PLANNER_SECONDS, seed=2000)
        # The last blocks came in less than a beat interval ago: let a beat plan them before the
        # beats stop (else they are simply not planned yet, which is not what this test is about).
        wait_for(
            lambda: (
                Movement.objects.filter(block__prefix_key__in=list(seeds)).values("block_id").distinct().count()
                == len(seeds)
            ),
            timeout=60,
            what="a move planned for every block written",
        )
        seen_double += _double_in_flight()
        for daemon, _ in daemons[1:]:  # stop sending; let the worker and the node finish
            _stop_beat(daemon)
        wait_for(
            lambda: not Movement.objects.filter(state__in=IN_FLIGHT).exists(),
            timeout=90,
            what="the node to finish every planned move",
        )
        logs = []
        for _, out in daemons:
            out.seek(0)  # type: ignore[attr-defined]
            logs.append(out.read())  # type: ignore[attr-defined]
        sent = [log.count("Scheduler: Sending due task") for log in logs[1:]]
        assert all(n >= 5 for n in sent), f"both beats sent the job repeatedly: {sent}"
        assert logs[0].count("(watermark, policy version") >= 5, "the control worker planned what the beats sent"

        assert seen_double == []
        movements, by_block = _movements_by_block()
        assert len({m.plan for m in movements}) >= 2
        for block_id, moves in by_block.items():
            assert [m.state for m in moves] == [MovementState.DONE], (
                block_id,
                [(m.id, m.state, m.detail) for m in moves],
            )
        assert len(by_block) == len(seeds)
        assert served_bytes_check(store, seeds) == {"served": len(seeds), "missed": 0}
        reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    finally:
        for daemon, out in daemons:
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(10)
            out.close()  # type: ignore[attr-defined]
        store.close()
