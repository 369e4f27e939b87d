"""L2 disk tier: one file per block in a local (NVMe) directory, written atomically, read at layer offsets.

A block file is ``[header, a multiple of 4 KiB][block bytes, padded to 4 KiB]``; the header holds
the key, the layout, the block and per-layer checksums and a hash of itself. A block is written
to a temporary name, fdatasync'ed and renamed, so no partial block is ever visible under its
final name; the directory is fsynced after the rename by a background pass within
DIRECTORY_SYNC_DELAY_S (one sync covers every rename into that directory meanwhile), or at once
by `sync()`, which a movement calls before it records a copy as READY. Its bytes are hashed on
the checksum engine's other thread while they are written, and the header goes last. Reads go straight into the destination tensor (no
bounce copy), the header with the first piece, in pieces hashed while the next is read, or just
the requested layers at their fixed offset.

I/O is O_DIRECT by default (large, aligned, page-cache free, the speed of the device); where the
filesystem refuses it, the tier logs that once and uses buffered I/O followed by
``posix_fadvise(DONTNEED)`` so blocks do not crowd the page cache. A request whose buffer or
range is not 4 KiB-aligned also takes the buffered path. Where CUDA and kvikio are present,
reads into GPU tensors go through kvikio's CuFile (GPUDirect Storage where available).

Capacity is shared by every process using the directory through a small ledger file
(``.strata-ledger``: stored bytes, pending bytes, blocks) updated under an exclusive flock; a
temporary file's name carries the writer's host, pid and reservation, so opening the tier
reconciles the ledger with the directory and removes what crashed writers left behind.

The same class serves as the `remote` tier on a shared filesystem mount (CephFS, NFS, Lustre,
3FS): see `worker.dataplane.tiers.remote.open_remote_tier`. There several hosts write into one
directory, and a pid says nothing about another host's processes: a temporary file of another
host is kept (and its reservation counted) until it has not changed for
FOREIGN_TEMP_GRACE_SECONDS, then removed as abandoned.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from worker.dataplane import native
from worker.dataplane.buffers import (
    DIRECT_IO_ALIGNMENT,
    aligned_empty,
    cuda_available,
    host_view,
    is_aligned,
    round_up,
)
from worker.dataplane.checksum import (
    BlockChecksum,
    ChecksumEngine,
    Span,
    layer_prefix,
)
from worker.dataplane.counters import Counters
from worker.dataplane.errors import BlockMissing, TierFull, TierUnavailable
from worker.dataplane.layout import DTYPE_CODES, BlockLayout
from worker.dataplane.tiers.base import PutResult, ReadResult, Tier, TierUsage
from worker.dataplane.tiers.header import HeaderInvalid, header_length, pack_header, parse_header

log = logging.getLogger(__name__)

MAGIC = b"STRATADK"
LEDGER_NAME = ".strata-ledger"
_LEDGER = struct.Struct("<QQQ")  # stored bytes, pending bytes, blocks
HEADER_CACHE_ENTRIES = 16384
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_DIRECTORY_SYNC_ERRNOS = {errno.EINVAL, errno.EOPNOTSUPP}
"""fsync of a directory refused this way means the filesystem does not sync directories (some
FUSE and network filesystems); the rename is then as durable as that filesystem makes it."""
DIRECTORY_SYNC_DELAY_S = 0.05
"""A rename is made durable (its directory fsynced) at most this long after it, in the background.
A directory fsync is a journal commit and a device cache flush (~2 ms on the dev box's virtio
disk): synced inside every `put` it cost a fifth of a 32 MiB block's write time (put 0.92x ->
0.76x of raw O_DIRECT writes); gathered, one flush covers the puts of this window. A put that
returned is complete under its name at once; until its directory is synced a crash of the
machine may lose the name (the block is then a miss, and the reconciler marks its placement
missing), which is why a movement calls `sync()` before it flips a copy to READY."""
FOREIGN_TEMP_GRACE_SECONDS = 3600
"""A temporary file of another host (a shared mount) is removed by `reconcile` only once it has
not been modified for this long. Its writer's pid cannot be checked from here, and removing a
live write would fail it and zero its reservation; a block write takes seconds, and an hour
also covers clock skew between the hosts and the file server (the age is the file's mtime
against this host's clock)."""
HOST_TOKEN_CHARS = 63
SPLIT_PIECE_BYTES = 1024 * 1024
"""A single large block read (`get`) is read in pieces of this many bytes by the calling thread
and the tier's I/O threads together, each hashing a piece right after reading it, while its bytes
are still in the CPU cache. On the dev box (virtio disk, 2 cores) one 32 MiB block read with 4
threads in 1 MiB pieces ran at 0.98-0.99x a single raw 32 MiB pread, with 2 threads in 4 MiB
pieces at 0.85x: hashing cold memory cost more than the whole read's CPU, and one read in flight
at a time left the device idle while either thread hashed."""
READ_PIECE_BYTES = 8 * 1024 * 1024
"""A block read into host memory is read in pieces of this many bytes (whole layers), each hashed
while the next is read. Smaller pieces hide more of the hash but make more, shorter reads."""
REUSE_DELETED_S = 10.0
"""A deleted block's file is kept this long (under a temporary name, its bytes counted as pending)
before it is unlinked, and a put of this process in that time writes its block over it instead
of creating a file: on the dev box's ext4 creating a file took 0.3-0.7 ms and an O_DIRECT write
into a new file's unallocated extents ~1.2 ms per 2 MiB, against ~0.7 ms into a written file's.
A cache tier deletes and puts all the time (evictions, moves), so most puts reuse a file. A put
takes a kept file before it looks for room, so kept files never make this process refuse one;
other processes sharing the directory see their bytes as used until they go. `drain_deletes`
unlinks them at once. 0 unlinks every deleted file at once."""


def host_token(name: str | None = None) -> str:
    """This host's name (`socket.gethostname()`, or `name`) as it appears in temporary file names:
    runs of characters other than ASCII letters, digits, '_' and '-' become one '-' (a dot would
    split the name's fields), at most HOST_TOKEN_CHARS of them. Hosts sharing a directory must
    have names that stay distinct this way."""
    raw = socket.gethostname() if name is None else name
    token = re.sub(r"[^A-Za-z0-9_-]+", "-", raw).strip("-")[:HOST_TOKEN_CHARS]
    return token or "unnamed-host"


class _NoRoomYet(Exception):
    """No room for a block yet, while deleted blocks' files are being unlinked (`_stage` waits
    for them and writes once more)."""


class _Unlinker:
    """Removes deleted blocks' files in the background. Freeing a 32 MiB file's extents took 4-9 ms
    per unlink on an ext4 mounted with `discard`; a move waited on that for each source it freed.
    `DiskTier.delete` renames the block to a temporary name (so it is gone at once, and
    `reconcile` of a later process removes it should this one die first) and hands it here; its
    bytes stay counted as pending in the ledger until the unlink is done.

    A file handed over as `reusable` is kept for `keep_s` first: a put in that time takes it
    (`take`) and writes its block over it instead of creating a file (see REUSE_DELETED_S)."""

    def __init__(self, ledger: _Ledger, *, tier: str, keep_s: float = 0.0) -> None:
        self._ledger = ledger
        self._tier = tier
        self._keep_s = keep_s
        # (path, size, when it may be unlinked: 0 = at once), oldest first.
        self._queue: collections.deque[tuple[Path, int, float]] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = 0
        self._hurry = 0  # drains under way: everything queued is unlinked at once
        self._closed = False

    def add(self, path: Path, size: int, *, reusable: bool = False) -> None:
        keep = reusable and self._keep_s > 0
        with self._wake:
            if self._closed:
                raise RuntimeError(f"the {self._tier} tier is closed")
            self._queue.append((path, size, time.monotonic() + self._keep_s if keep else 0.0))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"strata-{self._tier}-unlink", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()

    def take(self, size: int) -> Path | None:
        """The oldest kept file of `size` bytes, now the caller's (its bytes still counted as
        pending in the ledger); None when there is none."""
        with self._wake:
            for i, (path, queued_size, due) in enumerate(self._queue):
                if due and queued_size == size:
                    del self._queue[i]
                    self._busy -= 1
                    if not self._busy:
                        self._wake.notify_all()  # for `drain`; the unlink thread needs no wake
                    return path
        return None

    @property
    def busy(self) -> bool:
        """Files handed over are still being removed (or kept for reuse)."""
        return self._busy > 0

    def drain(self) -> None:
        """Return once every file handed over so far is removed, kept ones included."""
        with self._wake:
            self._hurry += 1
            self._wake.notify_all()
            try:
                while self._busy:
                    self._wake.wait()
            finally:
                self._hurry -= 1

    def close(self) -> None:
        self.drain()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _next(self) -> tuple[tuple[Path, int, float] | None, float | None]:
        """The first queued file due now (taken off the queue), else how long until one is."""
        now = time.monotonic()
        for i, entry in enumerate(self._queue):
            if self._hurry or entry[2] <= now:
                del self._queue[i]
                return entry, None
        if not self._queue:
            return None, None
        return None, min(due for _, _, due in self._queue) - now

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    entry, wait = self._next()
                    if entry is not None:
                        break
                    if self._closed and not self._queue:
                        return
                    self._wake.wait(wait)
            path, size, _due = entry
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a reconcile got there first
            except OSError as exc:
                # The bytes are still there, under a temporary name: counted as pending while
                # this process lives, removed by the reconcile of the next.
                log.warning("%s tier: removing the deleted block file %s failed: %s; it is removed "
                            "when the tier is next opened", self._tier, path, exc)
                size = 0
            if size:
                with self._ledger.locked() as state:
                    state[1] -= size
            with self._wake:
                self._busy -= 1
                self._wake.notify_all()


class _DirectorySyncer:
    """fsyncs the directories blocks were renamed into: in the background, DIRECTORY_SYNC_DELAY_S
    after the first rename of a quiet spell, or at once in `sync`. One pass at a time, so `sync`
    returns only once every rename before it, including those a background pass was syncing,
    is durable."""

    def __init__(self, sync_one: Callable[[Path], None], *, tier: str, counters: Counters) -> None:
        self._sync_one = sync_one
        self._tier = tier
        self._counters = counters
        self._dirty: set[Path] = set()
        self._wake = threading.Condition()
        self._pass_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failing: set[Path] = set()  # logged once per failing streak, not every pass

    def add(self, directories: Iterable[Path]) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError(f"the {self._tier} tier is closed")
            self._dirty.update(directories)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"strata-{self._tier}-dirsync", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def sync(self) -> None:
        """Make every rename so far durable; raises the first directory's failure (the failed
        directories stay to be synced again)."""
        errors = self._pass()
        if errors:
            directory, exc = errors[0]
            raise TierUnavailable(
                self._tier,
                reason=f"syncing the directory {directory} failed: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror or exc})",
            ) from exc

    def close(self) -> None:
        """A last pass, then stop the background thread (failures are logged)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self._pass()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._dirty and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return  # close() makes the last pass
            time.sleep(DIRECTORY_SYNC_DELAY_S)  # let the renames of this spell gather
            self._pass()

    def _pass(self) -> list[tuple[Path, OSError]]:
        with self._pass_lock:
            with self._wake:
                directories, self._dirty = self._dirty, set()
            errors: list[tuple[Path, OSError]] = []
            for directory in sorted(directories):
                try:
                    self._sync_one(directory)
                except FileNotFoundError:
                    continue  # removed meanwhile (a cleared tier): nothing in it to keep
                except OSError as exc:
                    errors.append((directory, exc))
                    continue
                self._failing.discard(directory)
            if errors:
                self._counters.add(f"{self._tier}.directory_sync_failures", len(errors))
                with self._wake:
                    self._dirty.update(directory for directory, _ in errors)
                for directory, error in errors:
                    if directory not in self._failing:
                        self._failing.add(directory)
                        log.error(
                            "%s tier: syncing the directory %s failed (%s); blocks renamed into it "
                            "may not survive a crash of this machine, retrying",
                            self._tier,
                            directory,
                            error,
                        )
            return errors


class _TempName(NamedTuple):
    """The fields of a temporary file's name."""

    host: str | None
    """None in names written before the host was recorded: those are this host's."""
    pid: int
    reserved: int


def _parse_temp_name(name: str) -> _TempName | None:
    """`.<key hex>.<pid>.<token>.<reserved bytes>.<host>.tmp`, or the same without `.<host>`;
    None for any other name."""
    parts = name.split(".")
    if len(parts) not in (6, 7) or parts[0] or parts[-1] != "tmp":
        return None
    try:
        pid, reserved = int(parts[2]), int(parts[4])
    except ValueError:
        return None
    return _TempName(host=parts[5] if len(parts) == 7 else None, pid=pid, reserved=reserved)


def _kvikio() -> Any | None:
    """kvikio's module where CUDA and kvikio are both present, else None."""
    if not cuda_available():
        return None
    try:
        import kvikio  # noqa: PLC0415 - optional GPU extra, imported only where it can work
    except ImportError:
        return None
    return kvikio


@dataclasses.dataclass(frozen=True)
class _Header:
    key: uuid.UUID
    checksum: BlockChecksum
    layers: int
    layer_bytes: int
    data_bytes: int
    dtype_code: int


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A block written to its temporary file, waiting to be synced and renamed."""

    key: uuid.UUID
    tmp: Path
    fd: int
    checksum: BlockChecksum
    io: str


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """Identity of one file version: a rename or rewrite changes it."""

    inode: int
    size: int
    mtime_ns: int


class _Ledger:
    """Stored/pending bytes and block count of a directory, shared by processes via flock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[int]]:
        """Yields [stored, pending, blocks]; changes are written back on exit."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _LEDGER.size, 0)
                state = list(_LEDGER.unpack(raw)) if len(raw) == _LEDGER.size else [0, 0, 0]
                before = list(state)
                yield state
                if state != before:
                    os.pwrite(self._fd, _LEDGER.pack(*(max(0, v) for v in state)), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


class _Opened(NamedTuple):
    """A block file opened for a batched layer read (`DiskTier._read_batch`)."""

    position: int
    """The item's place in the batch (its future's index)."""
    key: uuid.UUID
    dst: torch.Tensor
    fd: int
    stamp: _Stamp
    header: _Header
    direct: bool


class DiskTier(Tier):
    """Blocks as files under `path/<2 hex>/<key hex>.blk`, `capacity_bytes` of them in all."""

    def __init__(
        self,
        *,
        layout: BlockLayout,
        capacity_bytes: int,
        path: str | Path,
        counters: Counters | None = None,
        engine: ChecksumEngine | None = None,
        io_threads: int = 4,
        direct_io: bool = True,
        name: str = "disk",
        reuse_deleted_s: float = REUSE_DELETED_S,
    ) -> None:
        if reuse_deleted_s < 0:
            raise ValueError(f"reuse_deleted_s must be 0 or more seconds, got {reuse_deleted_s}")
        super().__init__(
            name=name, layout=layout, counters=counters, engine=engine, io_threads=io_threads
        )
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.header_bytes = round_up(
            header_length(layout), DIRECT_IO_ALIGNMENT
        )
        self.file_bytes = self.header_bytes + round_up(layout.block_bytes, DIRECT_IO_ALIGNMENT)
        self.direct_io = direct_io and self._direct_io_works()
        if direct_io and not self.direct_io:
            log.warning(
                "%s tier: the filesystem at %s refuses O_DIRECT; using buffered I/O with posix_fadvise(DONTNEED)",
                name,
                self.root,
            )
        self._kvikio = _kvikio()
        self._local = threading.local()
        self._headers: collections.OrderedDict[uuid.UUID, tuple[_Stamp, _Header]] = (
            collections.OrderedDict()
        )
        self._headers_lock = threading.Lock()
        self._ledger = _Ledger(self.root / LEDGER_NAME)
        self._dirs: set[Path] = set()
        self._syncer = _DirectorySyncer(self._sync_directory, tier=name, counters=self.counters)
        self._unlinker = _Unlinker(self._ledger, tier=name, keep_s=reuse_deleted_s)
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

    def path_of(self, key: uuid.UUID) -> Path:
        return self.root / key.hex[:2] / f"{key.hex}.blk"

    def _temp_path(self, final: Path, key: uuid.UUID, reserved: int) -> Path:
        """A temporary name of this process beside `final`, reserving `reserved` bytes: the
        reconciler of any host sharing the directory reads these fields (_parse_temp_name)."""
        return final.parent / (
            f".{key.hex}.{os.getpid()}.{secrets.token_hex(4)}.{reserved}.{self.host_token}.tmp"
        )

    def reconcile(self) -> TierUsage:
        """Recount the ledger from the directory, removing temporary files of dead writers: this
        host's whose process is gone, another host's once older than FOREIGN_TEMP_GRACE_SECONDS."""
        with self._ledger.locked() as state:
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
        return self.usage()

    def _live_reservation(self, entry: os.DirEntry[str], now: float) -> int | None:
        """The bytes a temporary file reserves while its writer may still be writing it; None
        when it was left behind (or its name is not one this tier writes)."""
        temp = _parse_temp_name(entry.name)
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

    # -- header ---------------------------------------------------------------------------
    def _pack_header(self, key: uuid.UUID, checksum: BlockChecksum) -> bytes:
        return pack_header(magic=MAGIC, layout=self.layout, key=key, checksum=checksum)

    def _parse_header(self, key: uuid.UUID, raw: memoryview) -> _Header:
        layout = self.layout
        try:
            checksum = parse_header(magic=MAGIC, layout=layout, key=key, raw=raw, holder="file")
        except HeaderInvalid as exc:
            raise self._corrupt(key, str(exc)) from None
        return _Header(
            key=key,
            checksum=checksum,
            layers=layout.layers,
            layer_bytes=layout.layer_bytes,
            data_bytes=layout.block_bytes,
            dtype_code=DTYPE_CODES[layout.dtype],
        )

    def _remember(self, key: uuid.UUID, stamp: _Stamp, header: _Header) -> None:
        with self._headers_lock:
            self._headers[key] = (stamp, header)
            self._headers.move_to_end(key)
            while len(self._headers) > HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)

    def _recall(self, key: uuid.UUID, stamp: _Stamp) -> _Header | None:
        with self._headers_lock:
            cached = self._headers.get(key)
        return cached[1] if cached is not None and cached[0] == stamp else None

    def _forget(self, key: uuid.UUID) -> None:
        with self._headers_lock:
            self._headers.pop(key, None)

    # -- per-thread buffers ---------------------------------------------------------------
    def _header_buffer(self) -> torch.Tensor:
        buffer = getattr(self._local, "header", None)
        if buffer is None:
            buffer = self._local.header = aligned_empty(self.header_bytes)
        return buffer

    def _staging(self, nbytes: int) -> torch.Tensor:
        """An aligned (pinned under CUDA) host buffer for I/O of GPU tensors, per I/O thread."""
        buffer = getattr(self._local, "staging", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._local.staging = aligned_empty(
                round_up(nbytes, DIRECT_IO_ALIGNMENT), pin=True
            )
        return buffer[:nbytes]

    # -- raw I/O --------------------------------------------------------------------------
    @staticmethod
    def _pread_exact(fd: int, views: list[memoryview], offset: int) -> int:
        """preadv until every view is full or the file ends; returns the bytes read."""
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            n = os.preadv(fd, _advance(views, done), offset + done)
            if n == 0:
                break
            done += n
        return done

    @staticmethod
    def _pwrite_exact(fd: int, views: list[memoryview], offset: int) -> None:
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            done += os.pwritev(fd, _advance(views, done), offset + done)

    def _open_for_read(self, key: uuid.UUID, *, direct: bool) -> tuple[int, _Stamp]:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            self.counters.add(f"{self.name}.misses")
            raise BlockMissing(key, tier=self.name) from None
        st = os.fstat(fd)
        return fd, _Stamp(inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)

    # -- Tier -----------------------------------------------------------------------------
    def put(
        self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None
    ) -> PutResult:
        result = self._commit([self._stage(key, data, checksum)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def put_many(
        self,
        items: Sequence[tuple[uuid.UUID, torch.Tensor]],
        *,
        checksums: Sequence[BlockChecksum | None] | None = None,
    ) -> list[Future[PutResult]]:
        """Group commit: every block is written to its temporary file on the I/O threads, then
        all are fdatasync'ed (the first sync commits the journal for all of them, so the rest
        cost little) and renamed; their directories are synced by the next background pass (or
        `sync`). Same guarantees as `put`, per block; every future resolves, whatever fails."""
        checksums = list(checksums) if checksums is not None else [None] * len(items)
        if len(checksums) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(checksums)} checksums")
        futures: list[Future[PutResult]] = [Future() for _ in items]
        if not items:
            return futures
        staged: list[_Staged | BaseException | None] = [None] * len(items)
        remaining = [len(items)]
        lock = threading.Lock()

        def stage(i: int) -> None:
            try:
                staged[i] = self._stage(items[i][0], items[i][1], checksums[i])
            except BaseException as exc:
                staged[i] = exc
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:  # the last block staged commits the batch, on this I/O thread
                ready = [(j, entry) for j, entry in enumerate(staged) if isinstance(entry, _Staged)]
                try:
                    results = self._commit([entry for _, entry in ready])
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting future
                    # `_commit` reports each block's failure itself; this is a failure it did
                    # not expect. Every future still resolves, and nothing stays a temporary
                    # file; the ledger is recounted when the tier next opens (reconcile).
                    for _, entry in ready:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.tmp)
                    results = [exc] * len(ready)
                outcome: dict[int, PutResult | BaseException] = dict(
                    zip([j for j, _ in ready], results, strict=True)
                )
                for j, staged_entry in enumerate(staged):
                    result = outcome.get(j, staged_entry)
                    if isinstance(result, BaseException):
                        futures[j].set_exception(result)
                    else:
                        futures[j].set_result(cast(PutResult, result))

        for i in range(len(items)):
            self._submit(stage, i)
        return futures

    def _stage(self, key: uuid.UUID, data: torch.Tensor, checksum: BlockChecksum | None) -> _Staged:
        """Write a block to a new temporary file (reserved in the ledger); not yet synced. Short
        of room (the quota or the filesystem) while blocks this process deleted are still being
        unlinked, it waits for their bytes and writes once more; TierFull only when nothing was
        being freed."""
        freeing = self._unlinker.busy
        try:
            return self._stage_once(key, data, checksum, wait_for_freed=freeing)
        except _NoRoomYet:
            self._unlinker.drain()
        return self._stage_once(key, data, checksum, wait_for_freed=False)

    def _stage_once(
        self, key: uuid.UUID, data: torch.Tensor, checksum: BlockChecksum | None, *, wait_for_freed: bool
    ) -> _Staged:
        src = self._block_bytes(data)
        layout = self.layout
        use_kvikio = False
        if src.device.type != "cpu":
            if checksum is not None and self._kvikio is not None:
                use_kvikio = True  # GPU memory straight to the file; nothing to hash on the host
            else:
                staging = self._staging(layout.block_bytes)
                staging.copy_(src)
                src = staging
        hashing: Future[list[bytes]] | None = None
        if checksum is None:
            # Hashed on the checksum engine's other thread while the bytes go to the file: the
            # header, which carries the checksum, is written last.
            hashing = self.engine.run_async(self._spans(key, src, range(layout.layers)))
        else:
            self._check_layers(checksum)
        final = self.path_of(key)
        tmp = self._temp_path(final, key, self.file_bytes)
        direct = (
            self.direct_io and not use_kvikio and is_aligned(src.data_ptr(), layout.block_bytes)
        )
        try:
            fd, tmp = self._reserve_and_create(tmp, direct=direct, wait_for_freed=wait_for_freed)
        except BaseException:
            if hashing is not None:
                hashing.exception()  # never leave a thread reading the caller's buffer
            raise
        try:
            header = self._header_buffer()
            header_view = host_view(header)
            if use_kvikio:
                assert checksum is not None
                self._fill_header(header_view, key, checksum)
                self._kvikio_write(fd, tmp, header, src)
            else:
                try:
                    self._pwrite_exact(fd, [host_view(src)], self.header_bytes)
                finally:
                    if hashing is not None:
                        checksum = BlockChecksum.from_layers(key, hashing.result())
                assert checksum is not None
                self._fill_header(header_view, key, checksum)
                self._pwrite_exact(fd, [header_view], 0)
                if layout.block_bytes != self.file_bytes - self.header_bytes:
                    os.ftruncate(
                        fd, self.file_bytes
                    )  # pad, so O_DIRECT reads of the tail stay aligned
        except BaseException as exc:
            os.close(fd)
            self._abandon(tmp)
            raise self._full_or(exc, tmp, wait_for_freed=wait_for_freed) from exc
        return _Staged(
            key=key,
            tmp=tmp,
            fd=fd,
            checksum=checksum,
            io="kvikio" if use_kvikio else "direct" if direct else "buffered",
        )

    def _fill_header(self, view: memoryview, key: uuid.UUID, checksum: BlockChecksum) -> None:
        packed = self._pack_header(key, checksum)
        view[: len(packed)] = packed
        view[len(packed) :] = bytes(self.header_bytes - len(packed))

    def _full_or(
        self, exc: BaseException, tmp: Path, doing: str = "writing", *, wait_for_freed: bool = False
    ) -> BaseException:
        """TierFull for a full filesystem or quota (counted), or _NoRoomYet when `wait_for_freed`;
        any other error as it is."""
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return self._no_room(wait_for_freed, detail=f"{exc.strerror} {doing} {tmp.name}")
        return exc

    def _no_room(self, wait_for_freed: bool, *, free: int | None = None, detail: str = "") -> Exception:
        """The error for a block that does not fit: _NoRoomYet while waiting for freed bytes is
        still worth it (`_stage` retries), else TierFull, counted."""
        if wait_for_freed:
            return _NoRoomYet()
        self.counters.add(f"{self.name}.full")
        return TierFull(self.name, needed=self.file_bytes, free=free, detail=detail)

    def _commit_error(self, exc: BaseException, path: Path, doing: str) -> BaseException:
        """What a put reports for `exc` raised while committing (`doing` `path`): TierFull for a
        full filesystem or quota, TierUnavailable for any other I/O error (a failing disk, a
        shared mount gone stale: the caller keeps the block elsewhere or recomputes), anything
        else as it was raised."""
        if not isinstance(exc, OSError):
            return exc
        error: BaseException
        if exc.errno in _FULL_ERRNOS:
            error = self._full_or(exc, path, doing)
        else:
            self.counters.add(f"{self.name}.unavailable")
            code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "OSError"
            error = TierUnavailable(
                self.name, reason=f"{doing} {path} failed: {code} ({exc.strerror or exc})"
            )
        error.__cause__ = exc  # these errors travel through futures, not `raise ... from`
        return error

    def _sync_directory(self, directory: Path) -> None:
        """fsync `directory`, making the names just created or renamed in it durable."""
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in _NO_DIRECTORY_SYNC_ERRNOS:
                raise
        finally:
            os.close(fd)

    def _commit(self, staged: Sequence[_Staged]) -> list[PutResult | BaseException]:
        """fdatasync every staged file, rename them into place under one ledger lock, and hand
        their directories to the syncer (a crash before it syncs them can lose a rename `put`
        already reported: see DIRECTORY_SYNC_DELAY_S). Returns a PutResult or an error per block,
        in order; a block that fails leaves no temporary file and no reservation behind, and the
        others go on."""
        layout = self.layout
        results: list[PutResult | BaseException | None] = [None] * len(staged)
        synced: list[tuple[int, _Staged, _Stamp]] = []
        for i, entry in enumerate(staged):
            try:
                os.fdatasync(entry.fd)
                if entry.io == "buffered":
                    os.posix_fadvise(entry.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                st = os.fstat(entry.fd)
            except BaseException as exc:
                os.close(entry.fd)
                self._abandon(entry.tmp)
                results[i] = self._commit_error(exc, entry.tmp, "syncing")
                continue
            os.close(entry.fd)
            synced.append(
                (i, entry, _Stamp(inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns))
            )
        try:
            placed = self._rename_into_place(synced, results)
        except BaseException as exc:
            # The ledger itself failed (its lock, read or write): no block of the batch counts
            # as committed. What is still a temporary file goes; a block renamed before the
            # failure is complete but unrecorded (an orphan), and the ledger is recounted when
            # the tier next opens.
            for i, entry, _stamp in synced:
                if results[i] is None:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.tmp)
                    results[i] = self._commit_error(exc, self._ledger.path, "updating the ledger")
            placed = []
        if placed:
            self._syncer.add({self.path_of(entry.key).parent for _, entry, _stamp in placed})
        for i, entry, stamp in placed:
            if results[i] is not None:
                continue
            self._remember(
                entry.key,
                stamp,
                _Header(
                    key=entry.key,
                    checksum=entry.checksum,
                    layers=layout.layers,
                    layer_bytes=layout.layer_bytes,
                    data_bytes=layout.block_bytes,
                    dtype_code=DTYPE_CODES[layout.dtype],
                ),
            )
            self.counters.add(f"{self.name}.io_{entry.io}")
            self.counters.add(f"{self.name}.puts")
            self.counters.add(f"{self.name}.bytes_written", layout.block_bytes)
            results[i] = PutResult(
                key=entry.key, tier=self.name, nbytes=layout.block_bytes, checksum=entry.checksum
            )
        return cast(list[PutResult | BaseException], results)

    def _rename_into_place(
        self,
        synced: Sequence[tuple[int, _Staged, _Stamp]],
        results: list[PutResult | BaseException | None],
    ) -> list[tuple[int, _Staged, _Stamp]]:
        """Rename the synced temporary files to their blocks' names under the ledger lock,
        moving each reservation to stored bytes; returns those renamed. A rename that fails
        sets `results[i]` and removes that temporary file and its reservation."""
        placed: list[tuple[int, _Staged, _Stamp]] = []
        if not synced:
            return placed
        with self._ledger.locked() as state:
            for i, entry, stamp in synced:
                final = self.path_of(entry.key)
                try:
                    try:
                        old: int | None = os.stat(final).st_size
                    except FileNotFoundError:
                        old = None
                    os.replace(entry.tmp, final)
                except OSError as exc:
                    results[i] = self._commit_error(exc, entry.tmp, "renaming into place")
                    try:
                        os.unlink(entry.tmp)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        # Still there: it stays reserved, as reconcile would count it, until
                        # this process is gone and a reconcile removes it.
                        continue
                    state[1] -= self.file_bytes
                    continue
                state[1] -= self.file_bytes
                state[0] += self.file_bytes - (old or 0)
                state[2] += 0 if old is not None else 1
                placed.append((i, entry, stamp))
        return placed

    def _reserve_and_create(
        self, tmp: Path, *, direct: bool, wait_for_freed: bool
    ) -> tuple[int, Path]:
        """Reserve a block's room in the ledger and create its temporary file `tmp`, or take a
        kept file of a deleted block instead (REUSE_DELETED_S; it keeps its own temporary name):
        returns the open file and its name. TierFull when there is no room (_NoRoomYet instead
        when `wait_for_freed`)."""
        with self._ledger.locked() as state:
            try:
                if tmp.parent not in self._dirs:
                    self._make_fanout(tmp.parent)
                    self._dirs.add(tmp.parent)
                reused = self._reuse_deleted(direct=direct)
                if reused is not None:
                    return reused
                used = state[0] + state[1]
                if used + self.file_bytes > self.capacity_bytes:
                    raise self._no_room(wait_for_freed, free=max(0, self.capacity_bytes - used))
                # Created under the ledger lock, so a reconcile never misses a live reservation.
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
                try:
                    fd = os.open(tmp, flags, 0o644)
                except FileNotFoundError:  # someone removed the fan-out directory meanwhile
                    self._make_fanout(tmp.parent)
                    fd = os.open(tmp, flags, 0o644)
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    raise self._no_room(wait_for_freed, detail=exc.strerror or "") from exc
                raise
            state[1] += self.file_bytes
            return fd, tmp

    def _reuse_deleted(self, *, direct: bool) -> tuple[int, Path] | None:
        """A kept file of a deleted block (REUSE_DELETED_S), opened for writing a block over it,
        and its name; None when there is none. It is a temporary file of this process that
        already reserves a block's bytes (they were counted as pending when its block was
        deleted): that reservation becomes this write's. Called under the ledger lock."""
        while (kept := self._unlinker.take(self.file_bytes)) is not None:
            try:
                fd = os.open(kept, os.O_WRONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError:
                continue  # a reconcile removed it (and recounted the ledger without it)
            except OSError as exc:
                log.warning("%s tier: reusing the deleted block file %s failed: %s", self.name,
                            kept, exc)
                self._unlinker.add(kept, self.file_bytes)  # unlinked (and uncounted) as usual
                return None
            # Written now, as far as the reconciler of another host sharing the directory can
            # tell (it removes temporary files idle for long): the block written over it was old.
            # Best effort: the first write sets the time too.
            with contextlib.suppress(OSError):
                os.utime(fd)
            self.counters.add(f"{self.name}.files_reused")
            return fd, kept
        return None

    def _make_fanout(self, directory: Path) -> None:
        """Create a fan-out directory if missing. A new one is synced into the root: a crash
        that lost its entry would lose every block later renamed into it (at most 256 syncs in
        a tier's life)."""
        try:
            directory.mkdir()
        except FileExistsError:
            return
        self._sync_directory(self.root)

    def _abandon(self, tmp: Path) -> None:
        with self._ledger.locked() as state:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            state[1] -= self.file_bytes

    @property
    def reads_into_device(self) -> bool:
        """With kvikio (CUDA): reads into GPU memory go through CuFile (GPUDirect Storage where
        the platform has it)."""
        return self._kvikio is not None

    def _kvikio_write(self, fd: int, tmp: Path, header: torch.Tensor, src: torch.Tensor) -> None:
        assert self._kvikio is not None  # only called when `_stage_once` chose kvikio, which needs it
        os.pwrite(fd, host_view(header), 0)
        with self._kvikio.CuFile(tmp, "r+") as cufile:
            cufile.pwrite(src, self.layout.block_bytes, self.header_bytes).get()
        os.ftruncate(fd, self.file_bytes)

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        dst = self._block_bytes(out)
        return self._read(key, range(self.layout.layers), dst, split=True)

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        """One task per I/O thread, each reading its share of the blocks one after another (the
        threads keep that many reads in flight): a hand-off per share, not per block, which
        matters for the many small reads of layer-wise loading."""
        selected = self.layout.layer_range(layers)
        dsts = self._layer_outs(selected, keys, outs)
        futures: list[Future[ReadResult]] = [Future() for _ in keys]
        shares = max(1, min(self.io_threads, len(keys)))

        def run(share: int) -> None:
            for i in range(share, len(keys), shares):
                try:
                    futures[i].set_result(self._read(keys[i], selected, dsts[i]))
                except BaseException as exc:  # noqa: BLE001 - handed to that block's future
                    futures[i].set_exception(exc)

        def run_batched(share: int) -> None:
            self._read_batch(
                [(i, keys[i], dsts[i]) for i in range(share, len(keys), shares)], selected, futures
            )

        batched = (
            native.available()
            and self.layout.span(selected)[1] <= READ_PIECE_BYTES
            and all(dst.device.type == "cpu" for dst in dsts)
        )
        for share in range(shares if keys else 0):
            self._submit(run_batched if batched else run, share)
        return futures

    def _read_batch(
        self,
        items: Sequence[tuple[int, uuid.UUID, torch.Tensor]],
        layers: range,
        futures: Sequence[Future[ReadResult]],
    ) -> None:
        """Read the same `layers` of many blocks into host buffers, setting `futures[i]` for each
        item (i, key, destination): the files are opened and their headers recalled here, then
        every read and its hash runs in one native call without the interpreter lock (the many
        small reads of layer-wise loading would otherwise each take several interpreter steps,
        contending with the model's own thread), then each block is verified on its own: a
        missing, short or corrupt block fails only its future."""
        layout = self.layout
        offset, nbytes = layout.span(layers)
        file_offset = self.header_bytes + offset
        opened: list[_Opened] = []
        try:
            for i, key, dst in items:
                direct = self.direct_io and is_aligned(dst.data_ptr(), nbytes, file_offset)
                try:
                    fd, stamp = self._open_for_read(key, direct=direct)
                except BaseException as exc:  # noqa: BLE001 - that block's future fails
                    futures[i].set_exception(exc)
                    continue
                try:
                    if stamp.size < self.file_bytes:
                        raise self._corrupt(
                            key, f"file is {stamp.size} bytes, a block file is {self.file_bytes}"
                        )
                    header = self._recall(key, stamp) or self._read_header(fd, key)
                except BaseException as exc:  # noqa: BLE001 - that block's future fails
                    os.close(fd)
                    futures[i].set_exception(exc)
                    continue
                opened.append(_Opened(i, key, dst, fd, stamp, header, direct))
            if not opened:
                return
            got, sums = native.ReadBatch(
                [entry.fd for entry in opened],
                [file_offset] * len(opened),
                [entry.dst.data_ptr() for entry in opened],
                [nbytes] * len(opened),
                layout.layer_bytes,
                [layer_prefix(entry.key, layer) for entry in opened for layer in layers],
            ).read()
        except BaseException as exc:  # noqa: BLE001 - no read was verified: every future fails
            for entry in opened:
                os.close(entry.fd)
                futures[entry.position].set_exception(exc)
            return
        for j, entry in enumerate(opened):
            try:
                if not entry.direct:
                    os.posix_fadvise(entry.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(entry.fd)
                self._check_read(entry.key, got[j], nbytes)
                self.counters.add(f"{self.name}.io_{'direct' if entry.direct else 'buffered'}")
                got_sums = sums[j * len(layers) : (j + 1) * len(layers)]
                futures[entry.position].set_result(
                    self._verified(entry.key, layers, entry.stamp, entry.header, got_sums)
                )
            except BaseException as exc:  # noqa: BLE001 - that block's future fails
                futures[entry.position].set_exception(exc)

    def _read(
        self, key: uuid.UUID, layers: range, dst: torch.Tensor, *, split: bool = False
    ) -> ReadResult:
        """Read and verify `layers` of a block into `dst`. `split` (a caller outside the tier's
        I/O threads, reading one block) lets the I/O threads share a large read with it."""
        layout = self.layout
        offset, nbytes = layout.span(layers)
        on_gpu = dst.device.type != "cpu"
        host_dst = dst if not on_gpu else self._staging(nbytes)
        file_offset = self.header_bytes + offset
        direct = self.direct_io and is_aligned(host_dst.data_ptr(), nbytes, file_offset)
        fd, stamp = self._open_for_read(key, direct=direct)
        hashing: list[Future[list[bytes]]] | None = None
        split_sums: list[bytes] | None = None
        try:
            if stamp.size < self.file_bytes:
                raise self._corrupt(
                    key, f"file is {stamp.size} bytes, a block file is {self.file_bytes}"
                )
            header = self._recall(key, stamp)
            if on_gpu and self._kvikio is not None:
                if header is None:
                    header = self._read_header(fd, key)
                with self._kvikio.CuFile(self.path_of(key), "r") as cufile:
                    got = cufile.pread(dst, nbytes, file_offset).get()
                if got != nbytes:
                    raise self._corrupt(key, f"short read of {got} bytes")
                host_dst.copy_(dst)  # verification needs the bytes on the host
            elif split and native.available() and nbytes >= 2 * SPLIT_PIECE_BYTES:
                header = header or self._read_header(fd, key)
                split_sums = self._read_split(fd, key, host_dst, layers, file_offset)
            else:
                header, hashing = self._read_hashing(fd, key, host_dst, layers, header)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            kind = (
                "kvikio"
                if on_gpu and self._kvikio is not None
                else "direct"
                if direct
                else "buffered"
            )
            self.counters.add(f"{self.name}.io_{kind}")
        finally:
            os.close(fd)
        if hashing is not None:
            got_sums = [digest for piece in hashing for digest in piece.result()]
        elif split_sums is not None:
            got_sums = split_sums
        else:
            got_sums = self.engine.run(self._spans(key, host_dst, layers))
        result = self._verified(key, layers, stamp, header, got_sums)
        if on_gpu and self._kvikio is None:
            dst.copy_(host_dst)
        return result

    def _verified(
        self,
        key: uuid.UUID,
        layers: range,
        stamp: _Stamp,
        header: _Header,
        got_sums: Sequence[bytes],
    ) -> ReadResult:
        """Check the hashes of `layers` just read against the header's (a mismatch quarantines
        the block and raises BlockCorrupt), remember the header, count the hit."""
        self._verify(key, layers, got_sums, header.checksum.layers[layers.start : layers.stop])
        self._remember(key, stamp, header)
        nbytes = len(layers) * self.layout.layer_bytes
        self.counters.add(f"{self.name}.hits")
        self.counters.add(f"{self.name}.bytes_read", nbytes)
        return ReadResult(
            key=key,
            tier=self.name,
            layers=layers,
            nbytes=nbytes,
            checksum=header.checksum if len(layers) == self.layout.layers else None,
        )

    def _spans(self, key: uuid.UUID, buffer: torch.Tensor, layers: range) -> list[Span]:
        """One span per layer of `buffer`, which holds `layers` back to back."""
        base, size = buffer.data_ptr(), self.layout.layer_bytes
        return [
            Span(src=base + j * size, nbytes=size, prefix=layer_prefix(key, layer))
            for j, layer in enumerate(layers)
        ]

    def _read_hashing(
        self, fd: int, key: uuid.UUID, dst: torch.Tensor, layers: range, header: _Header | None
    ) -> tuple[_Header, list[Future[list[bytes]]]]:
        """Read `layers` into `dst` a piece at a time, each piece hashed on the checksum engine's
        other thread while the next one is read, the last one on this thread (nothing is left to
        read meanwhile): verifying costs little more than the hash of the last piece. The header
        comes with the first piece when it is not known yet."""
        layout = self.layout
        size = layout.layer_bytes
        offset, _nbytes = layout.span(layers)
        view = host_view(dst)
        hashing: list[Future[list[bytes]]] = []
        try:
            for first, count in _pieces(len(layers), max(1, -(-READ_PIECE_BYTES // size)), alone=1):
                piece = view[first * size : (first + count) * size]
                at = self.header_bytes + offset + first * size
                if header is None and first == 0 and offset == 0:
                    hdr = self._header_buffer()  # header and first piece in one syscall
                    got = self._pread_exact(fd, [host_view(hdr), piece], 0)
                    if got != self.header_bytes + len(piece):
                        raise self._corrupt(key, f"short read of {got} bytes")
                    header = self._parse_header(key, host_view(hdr))
                else:
                    if header is None:
                        header = self._read_header(fd, key)
                    got = self._pread_exact(fd, [piece], at)
                    if got != len(piece):
                        raise self._corrupt(key, f"short read of {got} bytes")
                spans = self._spans(key, dst[first * size :], layers[first : first + count])
                if first + count >= len(layers):  # the last piece: nothing left to overlap its hash with
                    done: Future[list[bytes]] = Future()
                    done.set_result(self.engine.run(spans))
                    hashing.append(done)
                else:
                    hashing.append(self.engine.run_async(spans))
        except BaseException:
            for pending in hashing:  # never leave a thread reading a buffer the caller may free
                pending.exception()
            raise
        assert header is not None
        return header, hashing

    def _read_split(
        self, fd: int, key: uuid.UUID, dst: torch.Tensor, layers: range, file_offset: int
    ) -> list[bytes]:
        """Read `layers` into `dst` in pieces of SPLIT_PIECE_BYTES, shared between this thread
        and the tier's I/O threads as they go (each takes the next piece when it is done with its
        last, through a counter in the native reader), each piece hashed by the thread that read
        it as soon as it lands, one native call per thread without the interpreter lock: several
        reads stay in flight while any thread hashes, and the hash reads cached bytes. The last
        two layers are pieces of their own, so the threads finish within a layer's hash of each
        other. Returns the layer hashes in layer order."""
        size = self.layout.layer_bytes
        pieces = _pieces(len(layers), max(1, SPLIT_PIECE_BYTES // size), alone=2)
        base = dst.data_ptr()
        batch = native.ReadBatch(
            [fd] * len(pieces),
            [file_offset + first * size for first, _count in pieces],
            [base + first * size for first, _count in pieces],
            [count * size for _first, count in pieces],
            size,
            [layer_prefix(key, layer) for layer in layers],
        )
        helpers = [self._submit(batch.run) for _ in range(max(1, min(self.io_threads, len(pieces)) - 1))]
        try:
            batch.run()
        finally:
            for helper in helpers:
                helper.exception()  # never return (and let the caller free dst) while it still reads
        for helper in helpers:
            helper.result()
        got, sums = batch.results()
        for (_first, count), n in zip(pieces, got, strict=True):
            self._check_read(key, n, count * size)
        return sums

    def _check_read(self, key: uuid.UUID, got: int, want: int) -> None:
        """Raise for a native read that failed (`got` is -errno) or came short (the file is
        shorter than its block: corrupt, quarantined)."""
        if got < 0:
            raise OSError(-got, os.strerror(-got), str(self.path_of(key)))
        if got != want:
            raise self._corrupt(key, f"short read of {got} bytes")

    def _read_header(self, fd: int, key: uuid.UUID) -> _Header:
        hdr = self._header_buffer()
        got = self._pread_exact(fd, [host_view(hdr)], 0)
        if got != self.header_bytes:
            raise self._corrupt(key, f"short header read of {got} bytes")
        return self._parse_header(key, host_view(hdr))

    def checksum(self, key: uuid.UUID) -> BlockChecksum:
        """The stored checksum of a block (from its header; the data is not read)."""
        fd, stamp = self._open_for_read(key, direct=self.direct_io)
        try:
            header = self._recall(key, stamp) or self._read_header(fd, key)
        finally:
            os.close(fd)
        return header.checksum

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The file's data bytes (after the header; the alignment padding of a full-size file
        left out), read with plain buffered I/O apart from the tier's read paths."""
        try:
            with open(self.path_of(key), "rb") as f:
                f.seek(self.header_bytes)
                data = f.read()
        except FileNotFoundError:
            return None
        if len(data) == self.file_bytes - self.header_bytes:
            return data[: self.layout.block_bytes]
        return data

    def contains(self, key: uuid.UUID) -> bool:
        return self.path_of(key).exists()

    def delete(self, key: uuid.UUID) -> bool:
        """Remove a block: gone under its name when this returns; its file is unlinked in the
        background (`_Unlinker`), its bytes counted as pending until then."""
        self._forget(key)
        with self._ledger.locked() as state:
            path = self.path_of(key)
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
        DIRECTORY_SYNC_DELAY_S). Raises TierUnavailable when a directory cannot be synced."""
        self._syncer.sync()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._syncer.close()
        self._unlinker.close()
        self._ledger.close()


def _pieces(layers: int, per_piece: int, alone: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of each read of `layers` layers: pieces of `per_piece` layers,
    the last `alone` layers (fewer if there are not more than that many) each a piece of its own,
    so that what is left to hash after the last reads is one layer's."""
    body = max(layers - alone, 1 if layers else 0)
    pieces = [(first, min(per_piece, body - first)) for first in range(0, body, per_piece)]
    return pieces + [(first, 1) for first in range(body, layers)]


def _advance(views: list[memoryview], skip: int) -> list[memoryview]:
    """The views with the first `skip` bytes dropped (after a short read or write)."""
    if skip == 0:
        return views
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out
