"""A deleted disk block's file is kept a while and a put writes its block over it instead of
creating a file: the ledger stays exact, nothing partial is ever visible, the kept file goes after
its time or at once when asked, and a file someone else removed is simply not reused."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import TierFull
from worker.dataplane.tiers.disk import DiskTier

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".strata-ledger")


def _read(tier, n: int) -> torch.Tensor:
    out = LAYOUT.empty()
    tier.get(key(n), out)
    return out


def test_a_put_writes_over_the_file_of_a_deleted_block(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    inode = os.stat(tier.path_of(key(1))).st_ino
    tier.delete(key(1))
    kept = [name for name in _files(tier.root) if name.endswith(".tmp")]
    assert len(kept) == 1 and tier.usage().pending_bytes == tier.file_bytes
    tier.put(key(3), block_cache(LAYOUT, 3))
    assert os.stat(tier.path_of(key(3))).st_ino == inode  # the same file, written over
    assert tier.counters.get("disk.files_reused") == 1
    assert _files(tier.root) == sorted([f"{key(2).hex}.blk", f"{key(3).hex}.blk"])
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0
    assert usage.stored_bytes == 2 * tier.file_bytes
    assert torch.equal(_read(tier, 3), block_cache(LAYOUT, 3))
    assert torch.equal(_read(tier, 2), block_cache(LAYOUT, 2))
    assert tier.reconcile() == usage  # the ledger agrees with the directory
    # A batch reuses too, and a block written over a reused file reads back as itself.
    tier.delete(key(2))
    tier.delete(key(3))
    futures = tier.put_many([(key(4), block_cache(LAYOUT, 4)), (key(5), block_cache(LAYOUT, 5))])
    for future in futures:
        future.result(timeout=60)
    assert tier.counters.get("disk.files_reused") == 3
    assert torch.equal(_read(tier, 4), block_cache(LAYOUT, 4))
    assert torch.equal(_read(tier, 5), block_cache(LAYOUT, 5))
    assert tier.reconcile().pending_bytes == 0


def test_a_full_tier_takes_a_put_at_once_over_a_deleted_blocks_file(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, capacity_bytes=0)
    tier.capacity_bytes = 2 * tier.file_bytes
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.delete(key(1))
    assert tier.usage().used_bytes == 2 * tier.file_bytes  # the kept file still counts
    tier.put(key(3), block_cache(LAYOUT, 3))
    assert tier.usage().used_bytes == 2 * tier.file_bytes and tier.usage().blocks == 2
    assert tier.counters.get("disk.full") == 0
    with pytest.raises(TierFull):  # nothing kept and no room: refused
        tier.put(key(4), block_cache(LAYOUT, 4))


def test_a_kept_file_is_removed_after_its_time_or_at_once_by_drain(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4, reuse_deleted_s=0.3)
    for n in (1, 2):
        tier.put(key(n), block_cache(LAYOUT, n))
    tier.delete(key(1))
    assert tier.usage().pending_bytes == tier.file_bytes
    deadline = time.monotonic() + 10
    while tier.usage().pending_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.usage().pending_bytes == 0 and _files(tier.root) == [f"{key(2).hex}.blk"]
    slow = open_tier("disk", LAYOUT, blocks=4, path=tier.root, reuse_deleted_s=3600)
    slow.delete(key(2))
    assert slow.usage().pending_bytes == slow.file_bytes
    slow.drain_deletes()  # "every deleted block's bytes freed": kept files included
    assert slow.usage().pending_bytes == 0 and _files(slow.root) == []


def test_a_kept_file_someone_removed_is_not_reused_and_the_ledger_stays_exact(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.delete(key(1))
    [kept] = [p for p in tier.root.rglob("*.tmp")]
    kept.unlink()  # what an operator's cleanup or another host's sweep may do
    assert tier.reconcile().pending_bytes == 0
    tier.put(key(2), block_cache(LAYOUT, 2))
    assert tier.counters.get("disk.files_reused") == 0
    usage = tier.usage()
    assert usage.pending_bytes == 0 and usage.blocks == 1 and usage.stored_bytes == tier.file_bytes
    assert torch.equal(_read(tier, 2), block_cache(LAYOUT, 2))


def test_a_write_over_a_kept_file_that_fails_leaves_nothing(open_tier, block_cache, monkeypatch) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.delete(key(1))
    real = os.pwritev

    def enospc(fd, views, offset):
        real(fd, [views[0]], offset)  # part of the new block lands over the old one first
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", enospc)
    with pytest.raises(TierFull):
        tier.put(key(3), block_cache(LAYOUT, 3))
    monkeypatch.undo()
    assert _files(tier.root) == [f"{key(2).hex}.blk"]  # neither the kept file nor a partial one
    assert tier.usage().pending_bytes == 0 and tier.usage().blocks == 1
    assert not tier.contains(key(1)) and not tier.contains(key(3))
    tier.put(key(3), block_cache(LAYOUT, 3))
    assert torch.equal(_read(tier, 3), block_cache(LAYOUT, 3))


def test_a_negative_keep_time_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="reuse_deleted_s must be 0 or more seconds, got -1"):
        DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=tmp_path / "d", reuse_deleted_s=-1)
    assert not (tmp_path / "d").exists()  # refused before anything was created
