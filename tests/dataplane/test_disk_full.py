"""A full disk refuses with TierFull and leaves nothing partial; O_DIRECT falls back where refused."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch
from dataplane_support import ODD, SMALL, key, layout_of

from worker.dataplane.errors import TierFull
from worker.dataplane.tiers.disk import DiskTier

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".strata-ledger")


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 5 MiB filesystem (tmpfs), so ENOSPC comes from the kernel; skipped where mounting
    is not allowed (no root / no CAP_SYS_ADMIN)."""
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mountpoint)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True, timeout=30)


def test_a_really_full_filesystem_gives_tier_full_and_no_partial_file(small_tmpfs, open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, capacity_bytes=1 << 30, path=small_tmpfs / "disk")  # quota far above the fs
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    with pytest.raises(TierFull):
        tier.put(key(3), block_cache(LAYOUT, 3))
    assert not tier.contains(key(3))
    assert sorted(_leftovers(tier.root)) == sorted([f"{key(1).hex}.blk", f"{key(2).hex}.blk"])
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0 and usage.stored_bytes == 2 * tier.file_bytes
    assert tier.counters.get("disk.full") == 1
    # Room again: the same write succeeds, and the earlier blocks are intact.
    tier.delete(key(1))
    tier.put(key(3), block_cache(LAYOUT, 3))
    out = LAYOUT.empty()
    tier.get(key(2), out)
    assert torch.equal(out, block_cache(LAYOUT, 2))


def test_a_full_filesystem_waits_for_the_bytes_of_blocks_being_deleted(
    small_tmpfs, open_tier, block_cache, held_unlinks
) -> None:
    # Deleted files unlinked at once (not kept for reuse, see test_disk_reuse): the put must wait.
    tier = open_tier("disk", LAYOUT, capacity_bytes=1 << 30, path=small_tmpfs / "disk", reuse_deleted_s=0)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.delete(key(1))  # its file is still on the filesystem until the unlink is released
    threading.Timer(0.2, held_unlinks.set).start()
    tier.put(key(3), block_cache(LAYOUT, 3))  # ENOSPC first: waits for the unlink, then fits
    assert tier.contains(key(3)) and tier.counters.get("disk.full") == 0
    assert sorted(_leftovers(tier.root)) == sorted([f"{key(2).hex}.blk", f"{key(3).hex}.blk"])
    with pytest.raises(TierFull):  # nothing being freed: refused, and counted
        tier.put(key(4), block_cache(LAYOUT, 4))
    assert tier.counters.get("disk.full") == 1


@pytest.mark.parametrize("failing", ["pwritev", "fdatasync"])
def test_injected_enospc_midway_leaves_nothing_partial(failing: str, open_tier, block_cache, monkeypatch) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    real = getattr(os, failing)

    def enospc(fd, *args):
        if failing == "pwritev":
            views, offset = args
            real(fd, [views[0]], offset)  # part of the block reaches the temp file first
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing, enospc)
    with pytest.raises(TierFull):
        tier.put(key(2), block_cache(LAYOUT, 2))
    monkeypatch.undo()
    assert _leftovers(tier.root) == [f"{key(1).hex}.blk"]
    assert tier.usage().pending_bytes == 0 and tier.usage().blocks == 1
    tier.put(key(2), block_cache(LAYOUT, 2))
    assert tier.usage().blocks == 2


def test_the_quota_refuses_before_writing(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, capacity_bytes=0)
    probe = DiskTier(layout=LAYOUT, capacity_bytes=0, path=tier.root / "probe")
    probe.close()
    tier.capacity_bytes = 2 * probe.file_bytes
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    with pytest.raises(TierFull) as full:
        tier.put(key(3), block_cache(LAYOUT, 3))
    assert full.value.free == 0
    assert not tier.contains(key(3)) and tier.usage().used_bytes == 2 * tier.file_bytes


def test_reopening_reconciles_the_ledger_and_sweeps_crashed_writers(tmp_path, open_tier, block_cache) -> None:
    root = tmp_path / "shared"
    first = open_tier("disk", LAYOUT, blocks=3, path=root)
    first.put(key(1), block_cache(LAYOUT, 1))
    # A writer that died mid-block left a temp file; a live one's reservation must be kept.
    stale = root / key(2).hex[:2] / f".{key(2).hex}.999999999.dead.{first.file_bytes}.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"partial")
    live = root / key(3).hex[:2] / f".{key(3).hex}.{os.getpid()}.live.{first.file_bytes}.tmp"
    live.parent.mkdir(exist_ok=True)
    live.write_bytes(b"")
    second = open_tier("disk", LAYOUT, blocks=3, path=root)
    assert not stale.exists() and live.exists()
    usage = second.usage()
    assert usage.blocks == 1 and usage.pending_bytes == first.file_bytes
    second.put(key(4), block_cache(LAYOUT, 4))  # 1 stored + 1 pending + 1 new = 3 fit
    with pytest.raises(TierFull):
        second.put(key(5), block_cache(LAYOUT, 5))
    live.unlink()
    assert first.reconcile().pending_bytes == 0


def test_o_direct_refused_falls_back_to_buffered_io(tmp_path, monkeypatch, caplog, block_cache) -> None:
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="worker.dataplane.tiers.disk"):
        tier = DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=tmp_path / "nodirect")
    try:
        assert not tier.direct_io
        assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
        block = block_cache(LAYOUT, 1)
        tier.put(key(1), block)
        out = LAYOUT.empty()
        tier.get(key(1), out)
        assert torch.equal(out, block)
        assert tier.counters.get("disk.io_buffered") == 2 and tier.counters.get("disk.io_direct") == 0
    finally:
        tier.close()


def test_direct_io_is_used_where_aligned(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=2)
    assert tier.direct_io
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.get(key(1), LAYOUT.empty())
    tier.get_layers([key(1)], 3, [LAYOUT.empty(layers=1)])[0].result(timeout=30)
    assert tier.counters.get("disk.io_direct") == 3
    assert tier.path_of(key(1)).stat().st_size % 4096 == 0
    odd = layout_of(ODD, "float32")
    odd_tier = open_tier("disk", odd, blocks=2, path=tier.root.parent / "odd")
    odd_tier.put(key(2), block_cache(odd, 2))
    assert odd_tier.path_of(key(2)).stat().st_size % 4096 == 0  # padded
    assert odd_tier.counters.get("disk.io_buffered") == 1


def test_keys_lists_the_blocks(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=3)
    for n in (1, 2):
        tier.put(key(n), block_cache(LAYOUT, n))
    assert sorted(tier.keys(), key=uuid.UUID.__str__) == sorted([key(1), key(2)], key=uuid.UUID.__str__)
