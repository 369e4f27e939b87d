"""Faults: a PostgreSQL restart in the middle of a registration stream loses nothing; two processes
registering the same blocks at once end in one consistent state."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from controlplane.directory.models import Block, Placement
from worker.dataplane.directory import BlockRegistration, BlockTouch, DirectoryUnavailable
from worker.postgres_directory import DirectoryOptions, PostgresDirectory


def _count(connect, table):
    with connect() as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


@pytest.mark.slow
def test_registrations_survive_a_postgres_restart(private_pg):
    server, connect, model_key = private_pg
    # Touches go out with the next batch (an interval shorter than the outage), so the one sent
    # while the server is down meets a failed write and is dropped.
    options = DirectoryOptions(
        flush_interval_s=0.02,
        batch_size=200,
        retry_initial_s=0.05,
        retry_max_s=0.3,
        unavailable_s=0.2,
        touch_interval_s=0.02,
    )
    total, chunk = 3000, 10
    stop_at, restart_at = total // 3, 2 * total // 3
    regs = [
        BlockRegistration(
            namespace="tenant-a",
            model_key=model_key,
            prefix_key=uuid.uuid4(),
            content_key=uuid.uuid4(),
            position=16 * (i % 64),
            tokens=16,
            tier="host",
            node="gpu-0",
            nbytes=512,
        )
        for i in range(total)
    ]
    slowest_call = 0.0
    outage_lookups: list[float] = []
    with PostgresDirectory(connect=connect, options=options, announce=lambda **_: None) as directory:
        for start in range(0, total, chunk):
            if start == stop_at:
                assert server.stop() == "stopped"
                # While the database is down: lookups fail fast, touches are dropped and counted.
                for _ in range(3):
                    began = time.perf_counter()
                    with pytest.raises(DirectoryUnavailable):
                        directory.lookup(keys=[regs[0].prefix_key], node="gpu-0")
                    outage_lookups.append(time.perf_counter() - began)
                directory.touch(
                    touches=[BlockTouch(namespace="tenant-a", model_key=model_key, prefix_key=regs[0].prefix_key)]
                )
            if start == restart_at:
                assert server.start() == "started"
            began = time.perf_counter()
            directory.register(blocks=regs[start : start + chunk])
            slowest_call = max(slowest_call, time.perf_counter() - began)
            # About 1 s of registrations while the server is down, a few ms apart otherwise.
            time.sleep(0.01 if stop_at <= start < restart_at else 0.002)
        assert directory.flush(timeout=60), directory.stats()
        stats = directory.stats()
        print(stats, f"slowest register() {slowest_call * 1000:.2f} ms, outage lookups {outage_lookups}")
        # Lookups work again once the server is back.
        time.sleep(options.unavailable_s)
        hit = directory.lookup(keys=[regs[-1].prefix_key], node="gpu-0", namespace="tenant-a", model_key=model_key)
        assert hit.prefix_hit_blocks == 1
    assert _count(connect, "directory_block") == total
    assert _count(connect, "directory_placement") == total
    assert stats.pending == 0 and stats.rejected == 0
    assert stats.failed_flushes > 0 and stats.retried > 0, stats
    assert stats.flushed == total
    assert stats.dropped_touches == 1
    assert max(outage_lookups) < 0.5, outage_lookups
    assert slowest_call < 0.05, f"a register() call waited {slowest_call:.3f}s"


CHILD = r"""
import json, sys, uuid
import django
django.setup()
from controlplane.directory.services import blocks_register
from worker.dataplane.directory import BlockRegistration
spec = json.load(open(sys.argv[1]))
keys = spec["keys"]
for attempt in range(spec["rounds"]):
    batch = keys[attempt * spec["step"] % len(keys):][:spec["batch"]] or keys[:spec["batch"]]
    regs = []
    for i, (prefix, content) in enumerate(batch):
        for tier, node in (("host", spec["node"]), ("remote", None)):
            regs.append(BlockRegistration(namespace="tenant-a", model_key=uuid.UUID(spec["model_key"]),
                        prefix_key=uuid.UUID(prefix), content_key=uuid.UUID(content), position=0, tokens=16,
                        tier=tier, node=node, nbytes=4096, locator="shared" if node is None else spec["node"]))
    blocks_register(registrations=regs, source=spec["node"])
print("ok")
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_concurrent_registration_from_two_processes(
    tmp_path, subprocess_env, python, namespace, profile, node, other_node
):
    keys = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(1500)]
    procs = []
    for name in ("gpu-0", "gpu-1"):
        shuffled = keys[:]
        random.Random(name).shuffle(shuffled)
        spec = tmp_path / f"{name}.json"
        spec.write_text(
            json.dumps(
                {
                    "keys": shuffled,
                    "node": name,
                    "model_key": str(profile.model_key),
                    "rounds": 12,
                    "step": 250,
                    "batch": 500,
                }
            )
        )
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        procs.append(
            subprocess.Popen(
                [python, str(script), str(spec)],
                env=subprocess_env,
                cwd=Path.cwd(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    assert Block.objects.count() == len(keys)
    # Each block: one host copy per node and one shared remote copy, each at epoch 1 (nothing re-written).
    assert Placement.objects.count() == 3 * len(keys)
    assert set(Placement.objects.values_list("epoch", flat=True)) == {1}
    assert Placement.objects.filter(tier="remote", node__isnull=True).count() == len(keys)


@pytest.mark.django_db(transaction=True)
def test_concurrent_registration_from_threads(namespace, profile, node, other_node):
    """The same through two Directory clients (two writer connections) in one process."""
    keys = [(uuid.uuid4(), uuid.uuid4()) for _ in range(800)]
    clients = [
        PostgresDirectory(options=DirectoryOptions(flush_interval_s=0.01, batch_size=100), announce=lambda **_: None)
        for _ in range(2)
    ]
    barrier = threading.Barrier(2)

    def produce(client, node_name, seed):
        order = keys[:]
        random.Random(seed).shuffle(order)
        barrier.wait()
        for start in range(0, len(order), 40):
            client.register(
                blocks=[
                    BlockRegistration(
                        namespace="tenant-a",
                        model_key=profile.model_key,
                        prefix_key=p,
                        content_key=c,
                        position=0,
                        tokens=16,
                        tier=tier,
                        node=n,
                        nbytes=64,
                    )
                    for p, c in order[start : start + 40]
                    for tier, n in (("host", node_name), ("remote", None))
                ]
            )

    threads = [
        threading.Thread(target=produce, args=(c, n, i))
        for i, (c, n) in enumerate(zip(clients, ("gpu-0", "gpu-1"), strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for client in clients:
            assert client.flush(timeout=60)
            assert client.stats().rejected == 0 and client.stats().pending == 0
    finally:
        for client in clients:
            client.close()
    assert Block.objects.count() == len(keys)
    assert Placement.objects.count() == 3 * len(keys)
