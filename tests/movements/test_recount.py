"""The reconcile job recounts tier usage counters and heals them: writer processes SIGKILLed
mid-put and values deleted behind Strata's back leave the shared remote tier's usage hash wrong
(full before it is), the node's reconcile recounts it to the truth (counted apart here: SCAN and
STRLEN), says so in one log line, and the control plane's /metrics shows the drift it corrected."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis

from controlplane.telemetry.metrics import render_metrics
from tests.movements.conftest import node_report, random_block
from tests.support import remote_held as held
from worker.dataplane.errors import TierFull
from worker.movement_executor import MovementExecutor, MovementOptions

pytestmark = pytest.mark.django_db
REPO_ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import os, signal, sys, threading, uuid
    from worker.dataplane.errors import TierFull
    from worker.dataplane.layout import BlockLayout
    from worker.dataplane.tiers.remote import RemoteTier, redis_client
    from worker.dataplane.tiers.remote import tier as remote_tier

    url, prefix, mode = sys.argv[1:4]
    layout = BlockLayout(layers=2, kv_heads=2, head_dim=16, block_tokens=16, dtype="float16")
    # A short lease: what a killed writer reserved stops counting a second after it died.
    tier = RemoteTier(layout=layout, capacity_bytes=1 << 40, client=redis_client(url), prefix=prefix, lease_s=1.0)
    block = layout.empty()
    block.fill_(7)

    def die(*args, **kwargs):
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "before-set":  # killed with its room reserved, its value not sent
        remote_tier.set_without_join = die
        tier.put(uuid.uuid4(), block)
    elif mode == "after-set":  # killed with its value stored, not yet accounted
        settle = tier._usage.settle
        tier._usage.settle = lambda field, *, nbytes=0, blocks=0: die() if nbytes else settle(field)
        tier.put(uuid.uuid4(), block)
    else:  # puts in a loop on two threads until the test kills it, wherever it is
        def run():
            while True:
                tier.put(uuid.uuid4(), block)
                print("put", flush=True)

        for _ in range(2):
            threading.Thread(target=run, daemon=True).start()
        threading.Event().wait()
    """
)


def writer(url: str, prefix: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, prefix, mode],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def node(db):  # type: ignore[no-untyped-def]
    return node_report("gpu-0", disk=(1 << 30, 0), remote=(1 << 30, 0))


def test_killed_writers_and_values_evicted_behind_strata_are_recounted_to_the_truth(
    node, store_factory, redis_url, caplog
) -> None:
    store = store_factory(tiers=("remote",), blocks=64)
    remote = store.tier("remote")
    client = redis.Redis.from_url(redis_url)
    keys = [uuid.uuid4() for _ in range(6)]
    for n, key in enumerate(keys):
        store.put(key, random_block(store.layout, n), tier="remote")

    writers = {mode: writer(redis_url, remote.prefix, mode) for mode in ("before-set", "after-set", "loop")}
    try:
        for mode in ("before-set", "after-set"):
            out, err = writers[mode].communicate(timeout=180)
            assert writers[mode].returncode == -signal.SIGKILL and "dying" in out, err
        loop = writers["loop"]
        assert loop.stdout is not None
        puts = 0
        while puts < 20:
            line = loop.stdout.readline()
            assert line, loop.stderr.read() if loop.stderr else "the looping writer exited"
            puts += line.strip() == "put"
        os.kill(loop.pid, signal.SIGKILL)  # wherever its two threads are
        loop.wait(timeout=60)
    finally:
        for process in writers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    # Evicted, or deleted by hand: more values than the killed writers can have stored unaccounted
    # (one by after-set, up to one per looping thread), so the counts are over the truth whatever
    # instant the loop was killed at.
    client.delete(*[remote.key_name(key) for key in keys[:4]])

    truth = held(client, remote.prefix)
    wrong = remote.usage()
    assert (wrong.stored_bytes, wrong.blocks) != truth
    assert wrong.stored_bytes - truth[0] >= remote.value_bytes  # the values deleted behind its back
    assert wrong.pending_bytes >= remote.value_bytes  # the reservation of the writer killed before its SET

    # The tier full by its counts (not by what it holds): a write-through's put is refused...
    remote.capacity_bytes = wrong.stored_bytes
    time.sleep(1.2)  # the killed writers' leases lapse
    with pytest.raises(TierFull):
        store.put(uuid.uuid4(), random_block(store.layout, 10), tier="remote")
    counted = remote.usage()  # the refused put pruned the lapsed reservations
    assert counted.pending_bytes == 0 and counted.stored_bytes == wrong.stored_bytes

    executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions())
    with caplog.at_level(logging.WARNING, logger="strata.movements"):
        report = executor.reconcile("remote")
    drift = counted.used_bytes - truth[0]
    assert report.recounted and (report.drift_bytes, report.drift_blocks) == (drift, counted.blocks - truth[1])
    healed = remote.usage()
    assert (healed.stored_bytes, healed.blocks, healed.pending_bytes) == (*truth, 0)
    assert held(client, remote.prefix) == truth  # a recount changes counts, never values
    assert f"recount of the shared remote tier: its usage counters were off by {drift:+d} bytes" in caplog.text
    metrics = render_metrics().decode()
    assert f'strata_tier_accounting_drift_bytes{{node="",tier="remote"}} {float(drift)}' in metrics
    assert 'strata_tier_accounting_corrections_total{node="",tier="remote"} 1.0' in metrics

    # ...and accepted once the recount gave the hash the truth.
    store.put(uuid.uuid4(), random_block(store.layout, 11), tier="remote")
    assert not executor.reconcile("remote").drift_bytes
    metrics = render_metrics().decode()
    assert 'strata_tier_accounting_drift_bytes{node="",tier="remote"} 0.0' in metrics
    assert 'strata_tier_accounting_corrections_total{node="",tier="remote"} 1.0' in metrics


def test_a_node_tiers_drift_is_recorded_under_the_node(node, store_factory, caplog) -> None:
    store = store_factory(tiers=("disk",))
    disk = store.tier("disk")
    keys = [uuid.uuid4() for _ in range(3)]
    for n, key in enumerate(keys):
        store.put(key, random_block(store.layout, n), tier="disk")
    os.unlink(disk.path_of(keys[0]))  # behind the tier's back
    executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions())
    with caplog.at_level(logging.WARNING, logger="strata.movements"):
        report = executor.reconcile("disk")
    assert (report.drift_bytes, report.drift_blocks) == (disk.file_bytes, 1)
    assert "recount of tier disk on node gpu-0: its usage counters were off by" in caplog.text
    assert disk.usage().blocks == 2
    metrics = render_metrics().decode()
    assert f'strata_tier_accounting_drift_bytes{{node="gpu-0",tier="disk"}} {float(disk.file_bytes)}' in metrics
    assert 'strata_tier_accounting_drift_blocks{node="gpu-0",tier="disk"} 1.0' in metrics
