"""Committing a disk block: the directory is synced after the rename (in the background, or at
once by sync), and a commit that fails resolves every future with a typed error and leaves no
temp file, reservation or partial block."""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from pathlib import Path

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import TierFull, TierUnavailable
from worker.dataplane.tiers.disk import FOLDER_SYNC_DELAY_S

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks

OTHER_DIR_KEY = uuid.UUID(hex="a0" + "1" * 30)
"""A key whose block lives in another fan-out directory than key(n)'s (which all start 57)."""


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".strata-ledger")


@pytest.fixture
def io_log(monkeypatch):
    """Records, in order, every rename into place (("replace", directory inode)) and every fsync
    of a directory (("fsync-dir", directory inode)), with whether any future in `watched` was
    already resolved at that moment."""
    events: list[tuple[str, int, bool]] = []
    watched: list = []
    real_replace, real_fsync = os.replace, os.fsync

    def resolved() -> bool:
        return any(future.done() for future in watched)

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        events.append(("replace", os.stat(Path(dst).parent).st_ino, resolved()))

    def fsync(fd):
        st = os.fstat(fd)
        real_fsync(fd)
        if stat.S_ISDIR(st.st_mode):
            events.append(("fsync-dir", st.st_ino, resolved()))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    return events, watched


def test_a_rename_is_synced_by_sync_after_it_happened(open_tier, block_cache, io_log) -> None:
    events, _watched = io_log
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.sync()
    block_dir = os.stat(tier.path_of(key(1)).parent).st_ino
    root = os.stat(tier.root).st_ino
    # The new fan-out directory's own entry is synced into the root before any block goes in,
    # then the block's directory once the block is renamed into it, by the time sync returns.
    assert [(kind, inode) for kind, inode, _ in events] == [
        ("fsync-dir", root),
        ("replace", block_dir),
        ("fsync-dir", block_dir),
    ]
    events.clear()
    tier.put(key(2), block_cache(LAYOUT, 2))  # the directory exists now: only its own sync
    tier.sync()
    assert [(kind, inode) for kind, inode, _ in events] == [
        ("replace", block_dir),
        ("fsync-dir", block_dir),
    ]
    events.clear()
    tier.sync()  # nothing renamed since: nothing to sync
    assert events == []


def test_a_rename_is_synced_in_the_background_without_sync(open_tier, block_cache, io_log) -> None:
    events, _watched = io_log
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    block_dir = os.stat(tier.path_of(key(1)).parent).st_ino
    deadline = time.monotonic() + 5
    while ("fsync-dir", block_dir) not in [(kind, inode) for kind, inode, _ in events]:
        assert time.monotonic() < deadline, f"no background sync of the block's directory: {events}"
        time.sleep(FOLDER_SYNC_DELAY_S / 2)
    renamed = [(kind, inode) for kind, inode, _ in events].index(("replace", block_dir))
    assert [(kind, inode) for kind, inode, _ in events].index(("fsync-dir", block_dir)) > renamed


def test_puts_share_one_sync_per_directory(open_tier, block_cache, io_log) -> None:
    events, watched = io_log
    tier = open_tier("disk", LAYOUT, blocks=6)
    tier.put(key(9), block_cache(LAYOUT, 9))
    tier.put(OTHER_DIR_KEY, block_cache(LAYOUT, 9))  # both fan-out directories exist now
    tier.sync()
    events.clear()
    items = [(key(n), block_cache(LAYOUT, n)) for n in (1, 2, 3)]
    items.append((OTHER_DIR_KEY, block_cache(LAYOUT, 4)))
    futures = tier.put_many(items)
    watched.extend(futures)
    for future in futures:
        future.result(timeout=30)
    tier.sync()
    shared = os.stat(tier.path_of(key(1)).parent).st_ino
    other = os.stat(tier.path_of(OTHER_DIR_KEY).parent).st_ino
    syncs = [inode for kind, inode, _ in events if kind == "fsync-dir"]
    assert sorted(syncs) == sorted([shared, other])  # once per directory, not once per block
    for directory in (shared, other):
        last_rename = max(i for i, (kind, inode, _) in enumerate(events) if kind == "replace" and inode == directory)
        assert [(kind, inode) for kind, inode, _ in events].index(("fsync-dir", directory)) > last_rename


def test_sync_reports_a_directory_that_fails_and_syncs_it_again_later(open_tier, block_cache, monkeypatch) -> None:
    real_fsync = os.fsync
    failing = {"on": True}

    def eio_on_directories(fd):
        if failing["on"] and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))  # its fan-out directory exists before the fault
    tier.sync()
    monkeypatch.setattr(os, "fsync", eio_on_directories)
    tier.put(key(2), block_cache(LAYOUT, 2))  # the put itself succeeds: the block is complete
    with pytest.raises(TierUnavailable, match="syncing the directory .* EIO"):
        tier.sync()
    assert tier.counters.get("disk.directory_sync_failures") >= 1
    failing["on"] = False
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    tier.sync()  # the directory that failed was kept to be synced again
    assert synced, "the failed directory was not synced again"
    out = LAYOUT.empty()
    tier.get(key(2), out)
    assert torch.equal(out, block_cache(LAYOUT, 2))


def test_a_directory_that_cannot_be_synced_does_not_fail_the_put(open_tier, block_cache, monkeypatch) -> None:
    """Some filesystems refuse fsync on a directory (EINVAL): the rename is then as durable as
    they make it, and the put succeeds."""
    real_fsync = os.fsync

    def no_directory_sync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_directory_sync)
    tier = open_tier("disk", LAYOUT, blocks=2)
    tier.put(key(1), block_cache(LAYOUT, 1))
    assert tier.contains(key(1)) and tier.usage().blocks == 1


@pytest.mark.parametrize(
    ("code", "error"), [(errno.EIO, TierUnavailable), (errno.ENOSPC, TierFull)], ids=["eio", "enospc"]
)
def test_a_failed_rename_resolves_every_future_and_leaves_nothing(
    code: int, error: type[Exception], open_tier, block_cache, monkeypatch
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))

    def failing_replace(src, dst, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(src))

    monkeypatch.setattr(os, "replace", failing_replace)
    futures = tier.put_many([(key(n), block_cache(LAYOUT, n)) for n in (2, 3)])
    for future in futures:
        with pytest.raises(error) as raised:
            future.result(timeout=10)
        assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(error, match="renaming"):
        tier.put(key(4), block_cache(LAYOUT, 4))
    monkeypatch.undo()
    assert _leftovers(tier.root) == [f"{key(1).hex}.blk"]
    assert not any(tier.contains(key(n)) for n in (2, 3, 4))
    usage = tier.usage()
    assert usage.pending_bytes == 0 and usage.blocks == 1 and usage.stored_bytes == tier.file_bytes
    assert tier.reconcile() == usage  # the ledger agrees with the directory
    # Nothing was left behind that stops the same writes once the medium is back.
    for future in tier.put_many([(key(n), block_cache(LAYOUT, n)) for n in (2, 3)]):
        future.result(timeout=30)
    assert tier.usage().blocks == 3


def test_one_failed_rename_fails_only_its_block(open_tier, block_cache, monkeypatch) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    real_replace = os.replace
    refused = tier.path_of(key(2))

    def refuse_one(src, dst, *args, **kwargs):
        if Path(dst) == refused:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse_one)
    first, second, third = tier.put_many([(key(n), block_cache(LAYOUT, n)) for n in (1, 2, 3)])
    assert first.result(timeout=10).key == key(1) and third.result(timeout=10).key == key(3)
    with pytest.raises(TierUnavailable, match="EIO"):
        second.result(timeout=10)
    monkeypatch.undo()
    assert _leftovers(tier.root) == sorted([f"{key(1).hex}.blk", f"{key(3).hex}.blk"])
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0
    assert usage.stored_bytes == 2 * tier.file_bytes
    out = LAYOUT.empty()
    tier.get(key(3), out)
