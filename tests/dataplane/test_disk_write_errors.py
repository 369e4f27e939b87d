"""Every I/O error of a disk write is the tier's own error (TierUnavailable; TierFull for a full
filesystem or quota), counted, and fails only its block: the batch's other blocks are stored,
and a write-back step still stores and registers the rest of its blocks. Faults are injected
at the os call, for one block's files only, on a real disk tier."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.directory import BlockRegistration
from worker.dataplane.errors import TierFull, TierUnavailable
from worker.dataplane.eviction.local import MAX_FAILED_DELETES
from worker.dataplane.offload import OffloadManager
from worker.dataplane.profile import ModelProfile
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.disk.gds import kvikio_write

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks
PROFILE = ModelProfile(model_id="disk-write-errors", dtype="bfloat16", **SMALL)
FAILING = key(2)
"""The block whose files the injected faults hit."""
OTHER_DIR_KEY = uuid.UUID(hex="a0" + "1" * 30)
"""A key whose block lives in another fan-out directory than key(n)'s (which all start 57)."""


def _names_failing(name: str | os.PathLike[str]) -> bool:
    return FAILING.hex in os.fspath(name)


def _fd_is_failing(fd: int) -> bool:
    return _names_failing(os.readlink(f"/proc/self/fd/{fd}"))


def inject(monkeypatch: pytest.MonkeyPatch, call: str, code: int) -> None:
    """Make `os.<call>` fail with `code` on the FAILING block's files (every other call runs).
    A failing close closes the file first, as the kernel does (NFS reports a lost write there)."""
    real = getattr(os, call)

    def failing(target, *args, **kwargs):
        if call == "open":
            hit = _names_failing(target)
        else:
            hit = _fd_is_failing(target)
        if hit:
            if call == "close":
                real(target)
            raise OSError(code, os.strerror(code))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, call, failing)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".strata-ledger")


FAULTS = [
    pytest.param("pwritev", errno.EIO, TierUnavailable, "unavailable", id="write-eio"),
    pytest.param("pwritev", errno.ENOSPC, TierFull, "full", id="write-enospc"),
    pytest.param("pwritev", errno.EDQUOT, TierFull, "full", id="write-edquot"),
    pytest.param("open", errno.EIO, TierUnavailable, "unavailable", id="create-eio"),
    pytest.param("fdatasync", errno.EIO, TierUnavailable, "unavailable", id="fsync-eio"),
    pytest.param("fdatasync", errno.ENOSPC, TierFull, "full", id="fsync-enospc"),
    pytest.param("close", errno.EIO, TierUnavailable, "unavailable", id="close-eio"),
]


@pytest.mark.parametrize(("call", "code", "error", "counted"), FAULTS)
def test_a_write_fault_fails_only_its_block_as_the_tiers_error(
    call: str, code: int, error: type[Exception], counted: str, open_tier, block_cache, monkeypatch
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    inject(monkeypatch, call, code)
    first, failed, third = tier.put_many([(key(n), block_cache(LAYOUT, n)) for n in (1, 2, 3)])
    assert first.result(timeout=30).key == key(1) and third.result(timeout=30).key == key(3)
    with pytest.raises(error) as raised:
        failed.result(timeout=30)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == code
    with pytest.raises(error):  # the single put reports the same
        tier.put(FAILING, block_cache(LAYOUT, 2))
    assert tier.counters.get(f"disk.{counted}") == 2
    monkeypatch.undo()
    # No temporary file, reservation or partial block is left of the failed block.
    assert _leftovers(tier.root) == sorted([f"{key(1).hex}.blk", f"{key(3).hex}.blk"])
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0 and usage.stored_bytes == 2 * tier.file_bytes
    assert tier.reconcile() == usage
    tier.put(FAILING, block_cache(LAYOUT, 2))  # nothing stops the write once the medium is back
    out = LAYOUT.empty()
    tier.get(FAILING, out)
    assert torch.equal(out, block_cache(LAYOUT, 2))


def test_a_new_fanout_directory_that_cannot_be_synced_fails_only_its_block(open_tier, block_cache, monkeypatch) -> None:
    """The put that creates a fan-out directory syncs it into the root; EIO there fails that
    block (TierUnavailable, counted), the root is synced again once the disk answers."""
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))  # key(n)'s fan-out directory exists before the fault
    tier.sync()
    real_fsync = os.fsync
    failing = {"on": True}
    synced: list[int] = []

    def fsync(fd):
        st = os.fstat(fd)
        if failing["on"] and stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)
        synced.append(st.st_ino)

    monkeypatch.setattr(os, "fsync", fsync)
    same_dir, new_dir = tier.put_many([(key(2), block_cache(LAYOUT, 2)), (OTHER_DIR_KEY, block_cache(LAYOUT, 3))])
    assert same_dir.result(timeout=30).key == key(2)
    with pytest.raises(TierUnavailable, match="EIO"):
        new_dir.result(timeout=30)
    assert tier.counters.get("disk.unavailable") == 1
    assert not tier.contains(OTHER_DIR_KEY) and tier.usage().pending_bytes == 0
    failing["on"] = False
    tier.sync()
    assert os.stat(tier.root).st_ino in synced, "the root was not synced again after the failure"
    tier.put(OTHER_DIR_KEY, block_cache(LAYOUT, 3))
    assert tier.usage().blocks == 3


class RecordingDirectory:
    """The directory's side of write-back: what was registered and which placements changed."""

    def __init__(self) -> None:
        self.registered: list[BlockRegistration] = []
        self.changes: list = []

    def register(self, *, blocks: Sequence[BlockRegistration]) -> None:
        self.registered.extend(blocks)

    def change_placements(self, *, changes) -> None:
        self.changes.extend(changes)

    def touch(self, *, touches) -> None:
        pass

    def namespace_salt(self, name: str) -> bytes:
        return name.encode()


def write_back_step(manager: OffloadManager, block: Callable[[int], torch.Tensor], numbers: Sequence[int]) -> None:
    """One step's write-back, as the engines do it: each block stored, then the step's
    registrations in one batch."""
    registrations = []
    for n in numbers:
        registration = manager.store_block(
            key=key(n), content_key=key(100 + n), position=n * LAYOUT.block_tokens, namespace="ns", data=block(n)
        )
        if registration is not None:
            registrations.append(registration)
    manager.register(registrations)


@pytest.fixture
def disk_manager(open_tier):
    tier = open_tier("disk", LAYOUT, blocks=6)
    directory = RecordingDirectory()
    store = TieredStore(layout=LAYOUT, tiers=[tier], counters=tier.counters)
    manager = OffloadManager(
        store=store, profile=PROFILE, directory=directory, counters=tier.counters, write_back_tier="disk"
    )
    return manager, tier, directory


@pytest.mark.parametrize("call", ["pwritev", "fdatasync", "close"], ids=["write", "fsync", "close"])
def test_a_step_whose_block_fails_with_eio_stores_and_registers_the_others(
    call: str, disk_manager, block_cache, monkeypatch
) -> None:
    manager, tier, directory = disk_manager
    inject(monkeypatch, call, errno.EIO)
    write_back_step(manager, lambda n: block_cache(LAYOUT, n), [1, 2, 3, 4])
    monkeypatch.undo()
    assert [r.prefix_key for r in directory.registered] == [key(1), key(3), key(4)]
    assert tier.contains_many([key(n) for n in (1, 2, 3, 4)]) == [True, False, True, True]
    assert manager.counters.get("write_back.disk.stored") == 3
    assert manager.counters.get("write_back.disk.failed") == 1
    assert tier.counters.get("disk.unavailable") == 1
    for registration in directory.registered:  # what was registered is what the tier holds
        out = LAYOUT.empty()
        tier.get(registration.prefix_key, out)
        assert torch.equal(out, block_cache(LAYOUT, key_number(registration.prefix_key)))


def test_an_eviction_that_fails_with_eio_skips_the_block_counted(disk_manager, block_cache, monkeypatch) -> None:
    """A full tier evicts to make room; deletes that fail there (each the tier's own error,
    counted) keep their blocks, and after MAX_FAILED_DELETES fail that block's write only."""
    manager, tier, directory = disk_manager
    write_back_step(manager, lambda n: block_cache(LAYOUT, n), [1, 2, 3, 4, 5, 6])
    assert manager.counters.get("write_back.disk.stored") == 6
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):  # a delete renames the block out of its name first
        if str(src).endswith(".blk"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    write_back_step(manager, lambda n: block_cache(LAYOUT, n), [7])
    monkeypatch.undo()
    assert manager.counters.get("write_back.disk.failed") == 1
    assert manager.counters.get("eviction_failed.disk") == tier.counters.get("disk.unavailable") == MAX_FAILED_DELETES
    assert [r.prefix_key for r in directory.registered] == [key(n) for n in range(1, 7)]
    assert not tier.contains(key(7))
    assert tier.contains_many([key(n) for n in range(1, 7)]) == [True] * 6  # nothing lost to the faults
    assert len(manager.evictor.ledger.stats("disk")) == 6  # and nothing forgotten: evictable later
    write_back_step(manager, lambda n: block_cache(LAYOUT, n), [7])
    assert manager.counters.get("write_back.disk.stored") == 7


def key_number(block_key: uuid.UUID) -> int:
    return block_key.int - key(0).int


class _FailingCuFile:
    """kvikio's CuFile whose write fails as kvikio reports it (a RuntimeError), or comes up short."""

    def __init__(self, message: str | None) -> None:
        self.message = message

    def __call__(self, path, mode):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def pwrite(self, buf, size, offset):
        message = self.message

        class Written:
            def get(self) -> int:
                if message is not None:
                    raise RuntimeError(message)
                return size - 4096

        return Written()


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("cuFile error at: write.cpp: internal error (Input/output error)", errno.EIO),
        (f"Unable to write the file: {os.strerror(errno.ENOSPC)}", errno.ENOSPC),
        (None, errno.EIO),  # a short write
    ],
    ids=["eio", "enospc", "short"],
)
def test_a_kvikio_write_failure_is_an_os_error(message: str | None, code: int, tmp_path) -> None:
    """What the disk tier maps to its own errors: kvikio's failures come out of the GDS path as
    OSError with the errno they stand for."""
    kvikio = type("kvikio", (), {"CuFile": _FailingCuFile(message)})
    path = tmp_path / "block.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as raised:
            kvikio_write(
                kvikio,
                fd,
                path,
                torch.zeros(4096, dtype=torch.uint8),
                torch.zeros(8192, dtype=torch.uint8),
                header_bytes=4096,
                file_bytes=12288,
            )
    finally:
        os.close(fd)
    assert raised.value.errno == code
