"""The data plane's mover against a real TieredStore: verified copies in waves, and its result records."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dataplane_support import SMALL, key

from worker.dataplane import mover as mover_module
from worker.dataplane.config import load_config
from worker.dataplane.errors import TierUnavailable
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.mover import CopyJob, CopyResult, CopyStatus, Mover
from worker.dataplane.store import build_store

PROFILE = ModelProfile(model_id="test/small", dtype="bf16", **SMALL)
LAYOUT = block_layout(PROFILE)
B = LAYOUT.block_bytes


@pytest.fixture
def store(tmp_path, shm_name):
    config = load_config(
        overrides={
            "node_name": "node-a",
            "tiers": "device,host,disk",
            "device_bytes": 2 * B,
            "host_bytes": 16 * B,
            "disk_bytes": 16 * B,
            "disk_path": str(tmp_path / "{node}" / "disk"),
            "host_pool_name": shm_name,
        },
        environ={},
    )
    built = build_store(config, profile=PROFILE, environ={})
    yield built
    built.close()


def _blocks(store, tier: str, count: int, first: int = 0) -> dict:
    made = {}
    for n in range(first, first + count):
        data = torch.randint(0, 256, (B,), dtype=torch.uint8)
        put = store.put(key(n), data, tier=tier)
        made[key(n)] = (data, put.checksum.hex)
    return made


def _read(store, tier: str, block_key) -> torch.Tensor:
    buffer = LAYOUT.empty()
    store.tier(tier).get(block_key, buffer)
    return buffer.view(torch.uint8).reshape(-1).clone()


@pytest.mark.parametrize("verify", ["full", "header"])
@pytest.mark.parametrize(("source", "target"), [("host", "disk"), ("disk", "host")])
def test_copies_are_exact_verified_and_carry_the_source_checksum(store, verify, source, target) -> None:
    """host -> disk goes through the copy buffers; disk -> host reads straight into the pool."""
    made = _blocks(store, source, 5)
    mover = Mover(store, verify=verify)
    try:
        futures = mover.copy(
            [CopyJob(source=source, target=target, key=k, expected=c, size=B) for k, (_, c) in made.items()]
        )
        results = [future.result(timeout=60) for future in futures]
    finally:
        mover.close()
    assert [r.status for r in results] == [CopyStatus.DONE] * 5
    for (block_key, (data, checksum)), result in zip(made.items(), results, strict=True):
        assert result.written and result.checksum == checksum and result.error is None
        assert torch.equal(_read(store, target, block_key), data.view(torch.uint8))
        assert store.tier(source).contains(block_key)  # the mover never frees a source


def test_waves_of_a_batch_read_ahead_and_keep_their_order(store, monkeypatch) -> None:
    """A batch of waves with the writes slowed: the later waves' first blocks are read while the
    wave before them is still being written, and every result belongs to its own job."""
    made = _blocks(store, "host", 9)
    read_ahead = []
    job = mover_module.NextWave.job

    def counting(self, number):  # type: ignore[no-untyped-def]
        found = job(self, number)
        if found is not None:
            read_ahead.append(number)
        return found

    write = Mover._write_target

    def slow_write(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return write(self, *args)

    monkeypatch.setattr(mover_module.NextWave, "job", counting)
    monkeypatch.setattr(Mover, "_write_target", slow_write)
    mover = Mover(store)
    jobs = [CopyJob(source="host", target="disk", key=k, expected=c) for k, (_, c) in made.items()]
    try:
        with mover.batch() as batch:
            futures = [f for start in range(0, 9, 2) for f in batch.submit(jobs[start : start + 2])]
        results = [future.result() for future in futures]
    finally:
        mover.close()
    assert read_ahead, "no wave's first blocks were read ahead"
    assert [r.checksum for r in results] == [c for _, c in made.values()]
    assert all(r.done for r in results)


def test_a_damaged_or_missing_source_is_reported_and_nothing_is_written(store) -> None:
    made = _blocks(store, "host", 1)
    [(block_key, (_, checksum))] = made.items()
    mover = Mover(store)
    try:
        wrong, missing = mover.copy(
            [
                CopyJob(source="host", target="disk", key=block_key, expected="0" * 32),
                CopyJob(source="host", target="disk", key=key(99)),
            ]
        )
        wrong_result, missing_result = wrong.result(timeout=30), missing.result(timeout=30)
    finally:
        mover.close()
    assert wrong_result.status == CopyStatus.SOURCE_CORRUPT and not wrong_result.written
    assert "is not the recorded" in wrong_result.reason and wrong_result.checksum == checksum
    assert missing_result.status == CopyStatus.SOURCE_CORRUPT and not missing_result.written
    assert not store.tier("disk").contains(block_key)


def test_a_full_target_is_no_room(store) -> None:
    made = _blocks(store, "host", 3)
    mover = Mover(store)
    try:
        results = [
            f.result(timeout=30)
            for f in mover.copy(
                [CopyJob(source="host", target="device", key=k, expected=c) for k, (_, c) in made.items()]
            )
        ]
    finally:
        mover.close()
    assert [r.status for r in results] == [CopyStatus.DONE, CopyStatus.DONE, CopyStatus.NO_ROOM]
    assert not results[2].written and results[2].reason


def test_a_target_that_cannot_be_made_durable_fails_with_its_error(store, monkeypatch) -> None:
    made = _blocks(store, "host", 2)
    jobs = [CopyJob(source="host", target="disk", key=k, expected=c) for k, (_, c) in made.items()]
    mover = Mover(store)
    try:
        results = [f.result(timeout=30) for f in mover.copy(jobs)]
    finally:
        mover.close()
    assert mover.make_durable(jobs, results) == results

    def unsyncable() -> None:
        raise TierUnavailable("disk", reason="syncing the directory /x failed: EIO")

    monkeypatch.setattr(store.tier("disk"), "sync", unsyncable)
    failed = mover.make_durable(jobs, [*results[:1], CopyResult(status=CopyStatus.NO_ROOM, reason="full")])
    assert failed[0].status == CopyStatus.FAILED and isinstance(failed[0].error, TierUnavailable)
    assert failed[0].written and failed[0].checksum == results[0].checksum
    assert failed[1].status == CopyStatus.NO_ROOM  # nothing of it was written: nothing to sync


def test_a_bad_verify_mode_is_refused(store) -> None:
    with pytest.raises(ValueError, match="verify: expected one of full, header, got 'some'"):
        Mover(store, verify="some")


def test_the_mover_imports_no_django_celery_or_control_plane() -> None:
    code = (
        "import sys, worker.dataplane.mover; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('django', 'celery', 'controlplane') "
        "or m.startswith('worker.movement_executor')]; print(bad); assert not bad"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
