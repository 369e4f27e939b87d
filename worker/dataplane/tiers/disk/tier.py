"""The disk tier: one file per block in a directory, written atomically, read at layer offsets.

A block file is ``[header, a multiple of 4 KiB][block bytes, padded to 4 KiB]``; the header holds
the key, the layout, the block and per-layer checksums and a hash of itself. A block is written
to a temporary name, fdatasync'ed and renamed, so no partial block is ever visible under its
final name; the directory is fsynced after the rename by a background pass within
FOLDER_SYNC_DELAY_S (one sync covers every rename into that directory meanwhile), or at once
by `sync()`, which a movement calls before it records a copy as READY. Its bytes are hashed on
the hasher's other thread while they are written, and the header goes last. Reads go
straight into the destination tensor (no bounce copy), the header with the first piece, in
pieces hashed while the next is read, or just the requested layers at their fixed offset.

I/O is O_DIRECT by default (large, aligned, page-cache free, the speed of the device); where the
filesystem refuses it, the tier logs that once and uses buffered I/O followed by
``posix_fadvise(DONTNEED)`` so blocks do not crowd the page cache. A request whose buffer or
range is not 4 KiB-aligned also takes the buffered path. Where CUDA and kvikio are present,
reads into GPU tensors go through kvikio's CuFile (GPUDirect Storage where available).

Capacity is shared by every process using the directory through a small ledger file
(``.strata-ledger``: stored bytes, pending bytes, blocks) updated under an exclusive flock; a
temporary file's name carries the writer's host, pid and reservation, so opening the tier
reconciles the ledger with the directory and removes what crashed writers left behind.

The same tier serves the `remote` level on a shared filesystem mount (CephFS, NFS, Lustre,
3FS): see `worker.dataplane.tiers.mediums.remote_medium`. There several hosts write into one
directory, and a pid says nothing about another host's processes: a temporary file of another
host is kept (and its reservation counted) until it has not changed for
FOREIGN_TEMP_GRACE_SECONDS, then removed as abandoned.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
import uuid
from pathlib import Path

from worker.dataplane.buffers import DIRECT_IO_ALIGNMENT, aligned_empty, host_view
from worker.dataplane.checksum import Hasher
from worker.dataplane.counters import Counters
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.base import Recount, TierUsage
from worker.dataplane.tiers.disk.folder_sync import FolderSyncer, sync_folder
from worker.dataplane.tiers.disk.gds import load_kvikio
from worker.dataplane.tiers.disk.headers import HeaderCache, block_file_bytes, block_header_bytes
from worker.dataplane.tiers.disk.ledger import LEDGER_NAME, Ledger
from worker.dataplane.tiers.disk.names import (
    FOREIGN_TEMP_GRACE_SECONDS,
    host_token,
    parse_temp_name,
)
from worker.dataplane.tiers.disk.reads import DiskReads
from worker.dataplane.tiers.disk.unlinker import REUSE_DELETED_S, Unlinker
from worker.dataplane.tiers.disk.writes import DiskWrites

log = logging.getLogger(__name__)


class DiskTier(DiskReads, DiskWrites):
    """Blocks as files under `path/<2 hex>/<key hex>.blk`, `capacity_bytes` of them in all."""

    def __init__(
        self,
        *,
        layout: BlockLayout,
        capacity_bytes: int,
        path: str | Path,
        counters: Counters | None = None,
        hasher: Hasher | None = None,
        io_threads: int = 4,
        direct_io: bool = True,
        name: str = "disk",
        reuse_deleted_s: float = REUSE_DELETED_S,
    ) -> None:
        if reuse_deleted_s < 0:
            raise ValueError(f"reuse_deleted_s must be 0 or more seconds, got {reuse_deleted_s}")
        super().__init__(name=name, layout=layout, counters=counters, hasher=hasher, io_threads=io_threads)
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.header_bytes = block_header_bytes(layout)
        self.file_bytes = block_file_bytes(layout)
        self.direct_io = direct_io and self._direct_io_works()
        if direct_io and not self.direct_io:
            log.warning(
                "%s tier: the filesystem at %s refuses O_DIRECT; using buffered I/O with posix_fadvise(DONTNEED)",
                name,
                self.root,
            )
        self._kvikio = load_kvikio()
        self._local = threading.local()
        self._headers = HeaderCache()
        self._ledger = Ledger(self.root / LEDGER_NAME)
        self._dirs: set[Path] = set()
        self._syncer = FolderSyncer(sync_folder, tier=name, counters=self.counters)
        self._unlinker = Unlinker(self._ledger, tier=name, keep_s=reuse_deleted_s)
        self.host_token = host_token()
        self.reconcile()

    # -- files and the ledger -------------------------------------------------------------
    def _direct_io_works(self) -> bool:
        probe = self.root / f".strata-probe-{os.getpid()}-{secrets.token_hex(4)}"
        buffer = aligned_empty(DIRECT_IO_ALIGNMENT)
        buffer.zero_()
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        try:
            os.pwritev(fd, [host_view(buffer)], 0)
            return True
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def reconcile(self) -> TierUsage:
        """Recount the ledger from the directory, removing temporary files of dead writers: this
        host's whose process is gone, another host's once older than FOREIGN_TEMP_GRACE_SECONDS."""
        self._recount_ledger()
        return self.usage()

    def recount(self) -> Recount:
        """`reconcile`, reporting how far the ledger was from the directory. Safe beside writers
        in any process: it runs under the ledger's lock, which every write takes to create its
        temporary file (the reservation) and to rename it into place, so the directory it reads
        is a snapshot of what the ledger should say."""
        before, after = self._recount_ledger()
        return Recount(
            tier=self.name,
            drift_bytes=before[0] + before[1] - after[0] - after[1],
            drift_blocks=before[2] - after[2],
            usage=TierUsage(
                tier=self.name,
                capacity_bytes=self.capacity_bytes,
                stored_bytes=after[0],
                pending_bytes=after[1],
                blocks=after[2],
            ),
        )

    def _recount_ledger(self) -> tuple[list[int], list[int]]:
        """Set the ledger to the directory's blocks and live temporary files; returns the
        ledger's [stored, pending, blocks] before and after."""
        with self._ledger.locked() as state:
            before = list(state)
            stored = pending = blocks = 0
            now = time.time()
            for sub in os.scandir(self.root):
                if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                    continue
                for entry in os.scandir(sub.path):
                    if entry.name.endswith(".blk"):
                        stored += entry.stat(follow_symlinks=False).st_size
                        blocks += 1
                    elif entry.name.endswith(".tmp"):
                        reserved = self._live_reservation(entry, now)
                        if reserved is None:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.path)
                        else:
                            pending += reserved
            state[:] = [stored, pending, blocks]
        return before, [stored, pending, blocks]

    def _live_reservation(self, entry: os.DirEntry[str], now: float) -> int | None:
        """The bytes a temporary file reserves while its writer may still be writing it; None
        when it was left behind (or its name is not one this tier writes)."""
        temp = parse_temp_name(entry.name)
        if temp is None:
            return None
        if temp.host is not None and temp.host != self.host_token:
            # Another host's write: its pid means nothing here, only its age tells.
            try:
                idle = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                return None
            if idle <= FOREIGN_TEMP_GRACE_SECONDS:
                return temp.reserved
            log.warning(
                "%s tier: removing %s, a temporary file host %s has not written for %.0f s",
                self.name,
                entry.path,
                temp.host,
                idle,
            )
            return None
        try:
            os.kill(temp.pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return temp.reserved

    def keys(self) -> list[uuid.UUID]:
        """Keys of every block file (a snapshot, for the reconciler)."""
        found = []
        for sub in os.scandir(self.root):
            if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
                for entry in os.scandir(sub.path):
                    if entry.name.endswith(".blk"):
                        with contextlib.suppress(ValueError):
                            found.append(uuid.UUID(hex=entry.name[:-4]))
        return found

    @property
    def reads_into_device(self) -> bool:
        """With kvikio (CUDA): reads into GPU memory go through CuFile (GPUDirect Storage where
        the platform has it)."""
        return self._kvikio is not None

    def contains(self, key: uuid.UUID) -> bool:
        return self.path_of(key).exists()

    def delete(self, key: uuid.UUID) -> bool:
        """Remove a block: gone under its name when this returns; its file is unlinked in the
        background (`Unlinker`), its bytes counted as pending until then. TierUnavailable
        (counted) when the disk fails to say or do it (EIO, a stale mount); the block stays."""
        self._headers.forget(key)
        path = self.path_of(key)
        try:
            with self._ledger.locked() as state:
                try:
                    size = os.stat(path).st_size
                    # Should this process die before the unlink, the next reconcile removes the file.
                    doomed = self._temp_path(path, key, size)
                    os.rename(path, doomed)
                except FileNotFoundError:
                    return False
                state[0] -= size
                state[1] += size
                state[2] -= 1
        except OSError as exc:
            raise self._unavailable(exc, path, "deleting") from exc
        # A file of a block of this tier's size is kept a while, for a put to write over it.
        self._unlinker.add(doomed, size, reusable=size == self.file_bytes)
        return True

    def drain_deletes(self) -> None:
        self._unlinker.drain()

    def usage(self) -> TierUsage:
        with self._ledger.locked() as state:
            stored, pending, blocks = state
        return TierUsage(
            tier=self.name,
            capacity_bytes=self.capacity_bytes,
            stored_bytes=stored,
            pending_bytes=pending,
            blocks=blocks,
        )

    def sync(self) -> None:
        """Make every put that returned durable now: fsync the directories blocks were renamed
        into since the last sync (otherwise done in the background within
        FOLDER_SYNC_DELAY_S). Raises TierUnavailable when a directory cannot be synced."""
        self._syncer.sync()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._syncer.close()
        self._unlinker.close()
        self._ledger.close()
