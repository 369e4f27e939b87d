"""The bounded load test: 8 real node processes (`strata_node --model tiny`, small tiers, one
shared remote tier, each on its own PostgreSQL role and Redis user) move seeded blocks among
host, disk and remote as the planner keeps sending them, while another process runs 200 metadata
operations a second against the directory, and one fault a minute hits a random node (SIGKILL
then restart, or SIGSTOP past the visibility timeout then SIGCONT). One node reaches PostgreSQL
through a proxy that blackholes the path (drops everything, closes nothing) for a third of the
load; first, a node started on a Redis whose eviction policy is allkeys-lru must refuse to start.
At the end: every movement finished, a reconcile, zero invariant violations, no copy moved twice,
and every block's bytes identical to what was seeded.

Runs with `make test-soak` (marker `soak`, excluded from `make test`). STRATA_SOAK_SECONDS sets
the length of the load (default 120)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch
from django.db import connection

from controlplane.directory.models import Node, Placement
from controlplane.movements.choices import IN_FLIGHT
from controlplane.movements.models import Movement
from controlplane.movements.services import movements_plan, movements_redispatch, movements_warm
from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec
from tests.movements.conftest import random_block
from tests.movements.procs import DRAIN_HOST, REPO_ROOT, reconcile_and_check, write_blocks
from tests.support import BlackholeProxy, postgres_socket

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.soak]

SOAK_SECONDS = float(os.environ.get("STRATA_SOAK_SECONDS", "120"))
NODES = 8
BLOCKS_PER_NODE = 16
METADATA_OPS_PER_S = 200
FAULT_EVERY_S = 60.0
FIRST_FAULT_S = 30.0
VISIBILITY_TIMEOUT_S = 4  # tests.movements.fault_settings
STOPPED_FOR_S = VISIBILITY_TIMEOUT_S + 4
BLACKHOLE_AT_S = SOAK_SECONDS / 3
BLACKHOLE_FOR_S = min(20.0, SOAK_SECONDS / 3)
"""The first node's path to PostgreSQL drops everything from a third of the load on, for this long
(past its TCP user timeout and lookup deadline)."""

DRAIN_DISK = PolicySnapshot(
    version=2,
    mode="",
    classes=(),
    tiers=(TierPolicySpec(tier="disk", capacity_bytes=1, high_watermark=0.9, low_watermark=0.5),),
)


def say(line: str) -> None:
    """Progress in operator words (shown by `make test-soak`, which runs pytest with -s)."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {line}", flush=True)


def _double_in_flight() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT block_id FROM movements_movement WHERE state = ANY(%s) GROUP BY block_id HAVING count(*) > 1",
            [[s.value for s in IN_FLIGHT]],
        )
        return [row[0] for row in cursor.fetchall()]


def _movement_counts() -> dict[str, int]:
    from django.db.models import Count

    return {row["state"]: row["n"] for row in Movement.objects.values("state").annotate(n=Count("id"))}


class Faults:
    """One fault a minute on a random node: SIGKILL (and a new process at once), then SIGSTOP
    past the visibility timeout (and SIGCONT), alternating."""

    def __init__(self, nodes: list[Any], rng: random.Random) -> None:
        self.nodes = nodes
        self.rng = rng
        self.done: list[str] = []
        self.stopped: tuple[Any, subprocess.Popen, float] | None = None
        self.restarted: list[tuple[Any, subprocess.Popen]] = []

    def due(self, elapsed: float) -> bool:
        return elapsed >= FIRST_FAULT_S + FAULT_EVERY_S * len(self.done)

    def inject(self, elapsed: float) -> None:
        target = self.rng.choice(self.nodes)
        [process] = target.alive()
        if len(self.done) % 2 == 0:
            process.kill()
            process.wait(10)
            new, _ = target.start()
            self.restarted.append((target, new))
            self.done.append(f"SIGKILL {target.name} (pid {process.pid}) at {elapsed:.0f} s")
            say(
                f"fault: killed node {target.name}'s worker (pid {process.pid}); a new one (pid {new.pid}) is "
                "starting and will take over its unacknowledged moves"
            )
        else:
            os.kill(process.pid, signal.SIGSTOP)
            self.stopped = (target, process, time.monotonic() + STOPPED_FOR_S)
            self.done.append(f"SIGSTOP {target.name} (pid {process.pid}) at {elapsed:.0f} s for {STOPPED_FOR_S} s")
            say(
                f"fault: paused node {target.name}'s worker (pid {process.pid}) for {STOPPED_FOR_S} s, past the "
                f"broker's {VISIBILITY_TIMEOUT_S} s visibility timeout"
            )

    def tick(self) -> None:
        if self.stopped is not None and time.monotonic() >= self.stopped[2]:
            target, process, _ = self.stopped
            os.kill(process.pid, signal.SIGCONT)
            self.stopped = None
            say(
                f"fault over: node {target.name}'s worker (pid {process.pid}) continues; its late flips must be "
                "refused by the epochs"
            )
        for target, process in list(self.restarted):
            if Node.objects.filter(name=target.name, pid=process.pid).exists():
                self.restarted.remove((target, process))
                say(f"node {target.name} is back: its new worker (pid {process.pid}) heartbeats")

    def resume_all(self) -> None:
        if self.stopped is not None:
            self.stopped = (*self.stopped[:2], 0.0)
            self.tick()


def _random_action(rng: random.Random, names: list[str]) -> tuple[str, int]:
    """Plan one random batch of movements; returns what was planned and how many were written."""
    choice = rng.random()
    if choice < 0.45:
        name = rng.choice(names)
        return f"host->disk on {name}", len(movements_plan(snapshot=DRAIN_HOST, node=name, reason="manual").written)
    if choice < 0.75:
        return "disk->remote fleet-wide", len(movements_plan(snapshot=DRAIN_DISK, reason="schedule").written)
    name = rng.choice(names)
    return f"warm remote->host on {name}", len(movements_warm(node=name, limit=8).written)


def _drain(deadline_s: float) -> None:
    """Until nothing is in flight; every 20 s the redispatch sweep (a beat job) queues again
    what a fault stranded."""
    started = time.monotonic()
    swept = started
    while Movement.objects.filter(state__in=IN_FLIGHT).exists():
        if time.monotonic() - started > deadline_s:
            stuck = list(Movement.objects.filter(state__in=IN_FLIGHT).values_list("id", "state", "exec_node"))
            raise AssertionError(f"movements still in flight after {deadline_s:.0f} s: {stuck[:20]}")
        if time.monotonic() - swept > 20:
            swept = time.monotonic()
            say(f"redispatch sweep: {movements_redispatch(older_than=timedelta(0))}")
        time.sleep(0.5)


def _bytes_check(stores: dict[str, Any], seeds: dict[uuid.UUID, int], layout: Any) -> int:
    """Every seeded block has a READY copy and every READY copy reads back exactly the seeded bytes."""
    checked = 0
    any_store = next(iter(stores.values()))
    copies = Placement.objects.filter(block__prefix_key__in=list(seeds), state="ready").select_related("block", "node")
    held: set[uuid.UUID] = set()
    for copy in copies:
        key = copy.block.prefix_key
        store = any_store if copy.tier == "remote" else stores[copy.node.name]
        got = store.get(key, tiers=[copy.tier])
        assert torch.equal(got.data, random_block(layout, seeds[key])), f"block {key} in {copy.tier} has other bytes"
        held.add(key)
        checked += 1
    assert held == set(seeds), f"{len(set(seeds) - held)} seeded blocks have no READY copy"
    return checked


def _through_proxy(node: Any, proxy: BlackholeProxy, remote_prefix: str) -> None:
    """Give `node` its own credential with its database URL pointing at `proxy` (TCP on 127.0.0.1,
    forwarded to PostgreSQL's socket): every process it starts, restarts included, goes through it."""
    from urllib.parse import urlsplit, urlunsplit

    from tests.support import node_env

    credential = node_env({}, node.name, remote_prefix=remote_prefix)
    parts = urlsplit(credential["DATABASE_URL"])
    userinfo = parts.netloc.rpartition("@")[0]
    credential["DATABASE_URL"] = urlunsplit((parts.scheme, f"{userinfo}@127.0.0.1:{proxy.port}", parts.path, "", ""))
    node.credential = credential


class Outage:
    """The first node's path to PostgreSQL blackholed from BLACKHOLE_AT_S for BLACKHOLE_FOR_S: its
    heartbeats stop (and the movements it holds wait), and once the path returns it beats again and
    finishes what it holds; nothing may be lost. The faults leave this node alone: a node process
    that starts while its database is unreachable stops (its supervisor starts it again)."""

    def __init__(self, node: Any, proxy: BlackholeProxy) -> None:
        self.node, self.proxy = node, proxy
        self.began: float | None = None
        self.ended: float | None = None
        self.beats_during: set[int] = set()
        self.beats_after_start = 0

    def _beats(self) -> int:
        return int(Node.objects.filter(name=self.node.name).values_list("heartbeats", flat=True).first() or 0)

    def tick(self, elapsed: float) -> None:
        if self.began is None and BLACKHOLE_AT_S <= elapsed < float("inf"):
            self.proxy.blackhole()
            self.began = elapsed
            say(f"outage: node {self.node.name}'s path to PostgreSQL drops everything for {BLACKHOLE_FOR_S:.0f} s")
        if self.began is not None and self.ended is None:
            if elapsed >= self.began + 3:  # a heartbeat already in flight may still land
                self.beats_during.add(self._beats())
            if elapsed >= self.began + BLACKHOLE_FOR_S:
                self.proxy.restore()
                self.ended = min(elapsed, self.began + BLACKHOLE_FOR_S)
                self.beats_after_start = self._beats()
                say(
                    f"outage over: node {self.node.name}'s path to PostgreSQL forwards again (its heartbeat "
                    f"count stood at {sorted(self.beats_during)} while it was cut)"
                )

    def check(self) -> None:
        assert self.began is not None and self.ended is not None, "the outage ran"
        assert len(self.beats_during) == 1, f"node {self.node.name} kept beating through the outage"
        assert self._beats() > self.beats_after_start, f"node {self.node.name} did not beat again after the outage"

    def summary(self) -> str:
        return (
            f"node {self.node.name} lost its path to PostgreSQL for {BLACKHOLE_FOR_S:.0f} s (no heartbeat got "
            "through) and beat again after it"
        )


def _refused_on_an_evicting_redis(node_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node started on a Redis whose eviction policy is allkeys-lru stops at once, naming it:
    that Redis would drop the queues and the L3 usage hash under the load below."""
    from tests.support import RedisServer

    server = RedisServer(tmp_path / "evicting-redis")
    server.directory.mkdir()
    server.start()
    try:
        import redis

        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        probe = node_factory(prefix="soak-evict", tiers="device,host")
        process, log = probe.start(REDIS_URL=server.url)
        assert process.wait(120) != 0
        refusal = next(line for line in log.read_text().splitlines() if "maxmemory-policy is allkeys-lru" in line)
        say(f"a node on a Redis that evicts any key refused to start: {refusal.strip()}")
    finally:
        server.stop()


def test_soak_eight_nodes_moving_blocks_under_faults(node_factory, subprocess_env, python, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="strata.movements")  # the ledger tells what moved; no line per plan
    rng = random.Random(int(os.environ.get("STRATA_SOAK_SEED", "6")))
    remote_prefix = f"strata-soak-{uuid.uuid4().hex[:8]}"
    nodes = [
        node_factory(
            prefix="soak",
            tiers="device,host,disk,remote",
            host_bytes="4MiB",
            disk_bytes="16MiB",
            remote_prefix=remote_prefix,
            concurrency=2,
        )
        for _ in range(NODES)
    ]
    _refused_on_an_evicting_redis(node_factory, tmp_path)
    proxy = BlackholeProxy(postgres_socket())
    _through_proxy(nodes[0], proxy, remote_prefix)
    say(f"starting {NODES} node workers (model tiny, 4 MiB host, 16 MiB disk, one shared remote tier)")
    for node in nodes:
        node.start()
    for node in nodes:
        node.wait_up(node.started[-1][0], timeout=300)
    stores = {}
    loads: list[subprocess.Popen] = []
    load_outs = [open(tmp_path / f"metadata-load-{i}.log", "w+") for i in range(2)]
    try:
        for node in nodes:
            stores[node.name], profile = node.config_store()
        layout = next(iter(stores.values())).layout
        seeds: dict[uuid.UUID, int] = {}
        for i, node in enumerate(nodes):
            seeds.update(write_blocks(stores[node.name], profile, node.name, BLOCKS_PER_NODE, seed=10_000 * (i + 1)))
        names = [node.name for node in nodes]
        say(f"all {NODES} nodes up; {len(seeds)} blocks seeded with known bytes; load for {SOAK_SECONDS:.0f} s")

        # Two load processes of half the rate each: the directory is written from many processes.
        loads = [
            subprocess.Popen(
                [
                    python,
                    "manage.py",
                    "shell",
                    "-c",
                    "from tests.movements.soak.metadata_load import run; "
                    f"run(seconds={SOAK_SECONDS}, rate={METADATA_OPS_PER_S / 2}, namespace='soak-catalog-{i}')",
                ],
                cwd=REPO_ROOT,
                env=subprocess_env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            for i, out in enumerate(load_outs)
        ]
        faults = Faults(nodes[1:], rng)
        outage = Outage(nodes[0], proxy)
        planned: Counter[str] = Counter()
        doubles: list[int] = []
        started = time.monotonic()
        last_report = started
        while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
            if faults.due(elapsed) and faults.stopped is None:
                faults.inject(elapsed)
            faults.tick()
            outage.tick(elapsed)
            action, written = _random_action(rng, names)
            planned[action.split(" on ")[0]] += written
            doubles += _double_in_flight()
            if time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                counts = _movement_counts()
                in_flight = sum(counts.get(s, 0) for s in IN_FLIGHT)
                up = Node.objects.filter(name__in=names, state="up").count()
                say(
                    f"{elapsed:.0f} s of {SOAK_SECONDS:.0f} s: {up}/{NODES} nodes up; movements done "
                    f"{counts.get('done', 0)}, failed {counts.get('failed', 0)}, cancelled "
                    f"{counts.get('cancelled', 0)}, in flight {in_flight}; faults so far {len(faults.done)}"
                )
            time.sleep(0.5)
        faults.resume_all()
        outage.tick(float("inf"))
        say(f"load over after {time.monotonic() - started:.0f} s; waiting for every node and every movement")
        for node in nodes:
            node.wait_up(node.started[-1][0], timeout=300)
        assert [load.wait(120) for load in loads] == [0, 0]
        _drain(240)

        summary: Counter[str] = Counter()
        for out in load_outs:
            out.seek(0)
            lines = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
            assert lines and lines[-1].get("final") and lines[-1]["errors"] == 0, lines[-5:]
            summary.update({k: v for k, v in lines[-1].items() if k in ("registrations", "lookups", "touches")})
        ops = sum(summary.values())
        say(
            f"metadata load: {ops} operations in {SOAK_SECONDS:.0f} s ({ops / SOAK_SECONDS:.0f}/s): "
            f"{summary['registrations']} registrations, {summary['lookups']} lookups, {summary['touches']} touches"
        )

        assert doubles == [], "a block had two movements in flight"
        report = reconcile_and_check(stores)
        checked = _bytes_check(stores, seeds, layout)
        # No copy was moved twice: one finished move per (block, source copy, source epoch).
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT block_id, src_placement_id, src_epoch FROM movements_movement "
                "WHERE state = 'done' AND kind = 'move' GROUP BY 1, 2, 3 HAVING count(*) > 1"
            )
            assert cursor.fetchall() == []
        counts = _movement_counts()
        assert counts.get("done", 0) > 0
        assert faults.done or SOAK_SECONDS <= FIRST_FAULT_S, "the faults were injected"
        outage.check()
        say(
            f"done: movements {counts}; planned by route {dict(planned)}; faults: {'; '.join(faults.done)}; "
            f"invariants: {report.checked} READY copies verified, 0 violations, 0 orphans; "
            f"{checked} copies of {len(seeds)} seeded blocks read back identical; {outage.summary()}"
        )
    finally:
        proxy.close()
        for load in loads:
            if load.poll() is None:
                load.kill()
                load.wait(10)
        for out in load_outs:
            out.close()
        for store in stores.values():
            store.close()
        from redis import Redis

        from tests.movements.procs import remote_url_of_test

        client = Redis.from_url(remote_url_of_test())
        for name in client.scan_iter(match=f"{remote_prefix}:*"):
            client.delete(name)
        client.close()
