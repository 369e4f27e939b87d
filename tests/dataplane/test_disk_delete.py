"""Deleting a disk block: gone under its name at once, its file unlinked in the background (after
a while for reuse: test_disk_reuse) with its bytes counted as pending until then; a put short of
room waits for those bytes instead of refusing; a process that dies before the unlink leaves a
temporary file the next reconcile removes; a delete the disk fails is the tier's own error."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import BlockMissing, TierFull, TierUnavailable

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks
REPO_ROOT = Path(__file__).resolve().parents[2]


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".strata-ledger")


def test_a_deleted_block_is_gone_at_once_and_its_bytes_pending_until_unlinked(
    open_tier, block_cache, held_unlinks
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    assert tier.delete(key(1)) is True
    assert not tier.contains(key(1)) and not tier.path_of(key(1)).exists()
    with pytest.raises(BlockMissing):
        tier.get(key(1), LAYOUT.empty())
    assert tier.delete(key(1)) is False  # already gone
    usage = tier.usage()
    assert usage.blocks == 1 and usage.stored_bytes == tier.file_bytes
    assert usage.pending_bytes == tier.file_bytes  # on disk still, under a temporary name
    doomed = [name for name in _files(tier.root) if name.endswith(".tmp")]
    assert len(doomed) == 1 and doomed[0].startswith(f".{key(1).hex}.{os.getpid()}.")
    assert tier.reconcile().pending_bytes == tier.file_bytes  # a live process's file is kept
    held_unlinks.set()
    tier.drain_deletes()
    assert tier.usage().pending_bytes == 0 and tier.usage().blocks == 1
    assert _files(tier.root) == [f"{key(2).hex}.blk"]
    assert tier.get(key(2), LAYOUT.empty()).nbytes == LAYOUT.block_bytes


def test_a_put_short_of_room_waits_for_deleted_bytes_instead_of_refusing(open_tier, block_cache, held_unlinks) -> None:
    # Deleted files unlinked at once (not kept for reuse, see test_disk_reuse): the put must wait.
    tier = open_tier("disk", LAYOUT, capacity_bytes=0, reuse_deleted_s=0)
    tier.capacity_bytes = 2 * tier.file_bytes
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.delete(key(1))
    assert tier.usage().used_bytes == 2 * tier.file_bytes  # the file is not unlinked yet
    threading.Timer(0.2, held_unlinks.set).start()
    tier.put(key(3), block_cache(LAYOUT, 3))  # waits for the unlink, then fits
    assert tier.contains(key(3)) and tier.usage().blocks == 2
    assert tier.counters.snapshot().get("disk.full", 0) == 0
    with pytest.raises(TierFull):  # nothing being freed: refused at once, and counted
        tier.put(key(4), block_cache(LAYOUT, 4))
    assert tier.counters.snapshot()["disk.full"] == 1


def test_an_unlink_that_fails_is_logged_and_the_next_reconcile_removes_the_file(
    open_tier, block_cache, monkeypatch, caplog
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    real_unlink = os.unlink

    def failing_unlink(path, *args, **kwargs):
        if threading.current_thread().name.endswith("-unlink"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    with caplog.at_level(logging.WARNING, logger="strata"):
        tier.delete(key(1))
        tier.drain_deletes()
    assert "removing the deleted block file" in caplog.text and "Permission denied" in caplog.text
    assert tier.usage().pending_bytes == tier.file_bytes  # still on disk: still counted
    monkeypatch.setattr(os, "unlink", real_unlink)
    # Another process opening the tier sees a temporary file of a live process (this one) and
    # keeps it; once this process is gone, the file is swept (as for a writer that died).
    doomed = next(p for p in tier.root.rglob("*.tmp"))
    dead = doomed.with_name(doomed.name.replace(f".{os.getpid()}.", ".999999999.", 1))
    doomed.rename(dead)
    assert tier.reconcile().pending_bytes == 0 and not dead.exists()


def test_a_process_killed_before_the_unlink_leaves_nothing_after_the_next_open(
    tmp_path, open_tier, block_cache
) -> None:
    root = tmp_path / "disk"
    tier = open_tier("disk", LAYOUT, blocks=4, path=root)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.close()
    # A real process deletes a block and dies (SIGKILL) before its background unlink runs.
    script = textwrap.dedent(f"""
        import os, signal, sys, uuid
        sys.path.insert(0, {str(REPO_ROOT / "tests" / "dataplane")!r})
        from dataplane_support import SMALL, key, layout_of
        from worker.dataplane.tiers.disk import DiskTier
        real_unlink = os.unlink
        def unlink(path, *args, **kwargs):
            if path.endswith(".tmp") if isinstance(path, str) else str(path).endswith(".tmp"):
                print("deleted", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return real_unlink(path, *args, **kwargs)
        os.unlink = unlink
        tier = DiskTier(layout=layout_of(SMALL, "bfloat16"), capacity_bytes=1 << 30, path={str(root)!r})
        tier.delete(key(1))
        tier.drain_deletes()
    """)
    killed = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9 and "deleted" in killed.stdout, killed.stderr
    assert any(name.endswith(".tmp") for name in _files(root))  # the renamed file is still there
    reopened = open_tier("disk", LAYOUT, blocks=4, path=root)
    assert _files(root) == [f"{key(2).hex}.blk"]
    usage = reopened.usage()
    assert usage.blocks == 1 and usage.pending_bytes == 0 and usage.stored_bytes == reopened.file_bytes


@pytest.mark.parametrize("call", ["stat", "rename"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_a_delete_the_disk_fails_is_the_tiers_error_and_keeps_the_block(
    call: str, code: int, open_tier, block_cache, monkeypatch
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    before = tier.usage()
    real = getattr(os, call)

    def failing(path, *args, **kwargs):
        if str(path).endswith(".blk"):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(TierUnavailable, match=errno.errorcode[code]) as failed:
        tier.delete(key(1))
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == code
    assert tier.counters.get("disk.unavailable") == 1
    monkeypatch.undo()
    assert tier.contains(key(1)) and tier.usage() == before  # nothing half-done
    assert tier.delete(key(1)) is True
