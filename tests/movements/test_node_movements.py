"""Movements executed by REAL node processes (`manage.py strata_node --model tiny`) through the
real broker, and the faults the issue lists: SIGKILL after the copy and after the flip, SIGSTOP
past the visibility timeout. After each, the invariants I1-I4 are checked against the bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, ModelProfile, Node, Placement
from controlplane.directory.services import blocks_register
from controlplane.movements.choices import MovementState
from controlplane.movements.invariants import invariants_check
from controlplane.movements.models import Movement
from controlplane.movements.planner import plan
from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec
from tests.movements.conftest import random_block
from tests.support import free_port, wait_for
from worker.dataplane.directory import BlockRegistration
from worker.movements import MovementExecutor, MovementOptions

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

# Everything on the host tier is over this policy's capacity: every block moves to disk.
DRAIN_HOST = PolicySnapshot(version=1, mode="", classes=(), tiers=(
    TierPolicySpec(tier="host", capacity_bytes=1, high_watermark=0.9, low_watermark=0.5),))


class NodeProcesses:
    """Start node processes of one node name (same tiers, same queue); kill and log them."""

    def __init__(self, env: dict[str, str], python: str, tmp_path: Path) -> None:
        self.name = f"mv-{uuid.uuid4().hex[:6]}"
        self.tmp = tmp_path
        self.env = {**env, "DJANGO_SETTINGS_MODULE": "tests.movements.fault_settings",
                    "STRATA_HOST_POOL_NAME": f"strata-test-{self.name}", "STRATA_BLOCK_TOKENS": "16",
                    "STRATA_HOST_BYTES": "16MiB", "STRATA_DEVICE_BYTES": "4MiB",
                    "STRATA_TIERS": "device,host,disk,remote", "STRATA_REMOTE_PREFIX": f"strata-test-{self.name}"}
        self.python = python
        self.started: list[tuple[subprocess.Popen, Path]] = []

    def start(self, **extra_env: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"node-{len(self.started)}.log"
        process = subprocess.Popen(
            [self.python, "manage.py", "strata_node", "--name", self.name, "--heartbeat-seconds", "0.5",
             "--model", "tiny", "--serve-port", str(free_port()), "--disk-path", str(self.tmp / "disk"), "--disk-bytes", "64MiB"],
            cwd=REPO_ROOT, env={**self.env, **extra_env}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        )
        self.started.append((process, log))
        return process, log

    def wait_up(self, process: subprocess.Popen) -> None:
        """Until this process's worker heartbeats (its engine and store are up by then)."""
        wait_for(lambda: Node.objects.filter(name=self.name, pid=process.pid).exists(), timeout=120,
                 what=f"a heartbeat of node process {process.pid}")

    def config_store(self):  # type: ignore[no-untyped-def]
        """This test's own view of the node's tiers: the same shared-memory pool, disk directory
        and remote prefix (the pool is shared by every process of the node)."""
        from worker.dataplane.config import load_config
        from worker.dataplane.layout import ModelProfile as LayoutProfile
        from worker.dataplane.store import build_store

        row = wait_for(lambda: ModelProfile.objects.first(), what="the node's model profile")
        profile = LayoutProfile(model_id=row.model_id, layers=row.layers, kv_heads=row.kv_heads,
                                head_dim=row.head_dim, dtype=row.dtype, block_tokens=row.block_tokens,
                                revision=row.revision, rope_theta=row.rope_theta, rope_scaling=row.rope_scaling)
        env = {**self.env, "REDIS_URL": _remote_url()}
        config = load_config(environ=env, overrides={"node_name": self.name, "disk_path": str(self.tmp / "disk"),
                                                     "disk_bytes": "64MiB", "tiers": "host,disk,remote"})
        return build_store(config, profile=profile, environ=env), row

    def stop_all(self) -> None:
        for process, log in self.started:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
            print(f"--- {log.name}\n" + log.read_text()[-3000:])
        for pool in Path("/dev/shm").glob(f"strata-test-{self.name}*"):
            pool.unlink(missing_ok=True)


def _remote_url() -> str:
    from django.conf import settings

    return settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)


@pytest.fixture
def nodes(subprocess_env, python, tmp_path) -> Iterator[NodeProcesses]:
    processes = NodeProcesses(subprocess_env, python, tmp_path)
    yield processes
    processes.stop_all()


def _write_blocks(store, profile, node: str, count: int) -> list[Block]:  # type: ignore[no-untyped-def]
    keys = [uuid.uuid4() for _ in range(count)]
    registrations = []
    for i, key in enumerate(keys):
        result = store.put(key, random_block(store.layout, 100 + i), tier="host")
        registrations.append(BlockRegistration(
            namespace="default", model_key=profile.model_key, prefix_key=key, content_key=uuid.uuid4(), position=0,
            tokens=profile.block_tokens, tier="host", node=node, nbytes=store.layout.block_bytes,
            checksum=result.checksum.hex))
    blocks_register(registrations=registrations)
    wait_for(lambda: Node.objects.get(name=node).tiers.filter(tier="host", used_bytes__gt=0).exists(),
             what="the host use in a heartbeat")
    return list(Block.objects.filter(prefix_key__in=keys))


def _state_of(ident: int) -> str:
    return Movement.objects.get(id=ident).state


def _check_after(store, node: str) -> None:  # type: ignore[no-untyped-def]
    """Reconcile (grace 0: every node process is gone or idle), then I1-I4 must hold."""
    reconciler = MovementExecutor(node=node, store=store, options=MovementOptions(reconcile_grace_s=0))
    for tier in ("host", "disk"):
        reconciler.reconcile(tier)
    report = invariants_check(stores={node: store})
    assert report.ok, (report.violations, report.orphans, report.double_in_flight)
    assert report.checked > 0


def test_a_real_node_executes_a_planned_move_through_the_broker(nodes):
    process, log = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        blocks = _write_blocks(store, profile, nodes.name, 4)
        result = plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(result.written) == 4
        wait_for(lambda: all(_state_of(i) == MovementState.DONE for i in result.written), timeout=60,
                 what="the node to execute the moves")
        for block in blocks:
            [copy] = Placement.objects.filter(block=block)
            assert (copy.tier, copy.node.name, copy.state) == ("disk", nodes.name, PlacementState.READY)
        assert all(m.bytes == store.layout.block_bytes and m.attempts == 1
                   for m in Movement.objects.filter(id__in=result.written))
        assert "host->disk): done" in log.read_text()
        _check_after(store, nodes.name)
    finally:
        store.close()


@pytest.mark.parametrize("point", ["after-copy", "after-flip"])
def test_sigkill_mid_move_then_a_new_worker_finishes_it(nodes, point):
    victim, victim_log = nodes.start(STRATA_FAULT_POINT=point)
    nodes.wait_up(victim)
    store, profile = nodes.config_store()
    try:
        [block] = _write_blocks(store, profile, nodes.name, 1)
        result = plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        [ident] = result.written
        wait_for(lambda: f"held at {point}" in victim_log.read_text(), timeout=60, what=f"the worker to reach {point}")
        victim.kill()
        victim.wait(10)
        # Killed between copy and flip the old copy is still the served one; between flip and free
        # the new one is. Either way exactly one READY copy, and its bytes are good.
        ready = list(Placement.objects.filter(block=block, state=PlacementState.READY).values_list("tier", flat=True))
        assert ready == (["host"] if point == "after-copy" else ["disk"])
        assert invariants_check(stores={nodes.name: store}, orphans=False).violations == []
        _, log = nodes.start()  # same node, no fault: the broker delivers the unacked message again
        wait_for(lambda: _state_of(ident) == MovementState.DONE, timeout=90, what="the redelivered move")
        assert list(Placement.objects.filter(block=block).values_list("tier", "state")) == [("disk", "ready")]
        assert Movement.objects.get(id=ident).attempts == 2
        _check_after(store, nodes.name)
    finally:
        store.close()


def test_sigstop_past_the_visibility_timeout_the_late_flip_is_refused(nodes):
    stopped, stopped_log = nodes.start(STRATA_FAULT_POINT="after-copy", STRATA_FAULT_HOLD_S="2")
    nodes.wait_up(stopped)
    store, profile = nodes.config_store()
    try:
        [block] = _write_blocks(store, profile, nodes.name, 1)
        [ident] = plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual").written
        wait_for(lambda: "held at after-copy" in stopped_log.read_text(), timeout=60, what="the worker to hold")
        os.kill(stopped.pid, signal.SIGSTOP)
        _, log = nodes.start()
        wait_for(lambda: _state_of(ident) == MovementState.DONE, timeout=90, what="the other worker to take over")
        os.kill(stopped.pid, signal.SIGCONT)
        wait_for(lambda: "flip refused" in stopped_log.read_text(), timeout=60, what="the late worker's refused flip")
        time.sleep(1)
        assert list(Placement.objects.filter(block=block).values_list("tier", "state")) == [("disk", "ready")]
        assert Movement.objects.get(id=ident).state == MovementState.DONE
        _check_after(store, nodes.name)
    finally:
        store.close()
