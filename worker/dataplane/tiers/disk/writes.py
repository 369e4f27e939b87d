"""The disk tier's writes: a block staged in a temporary file (reserved in the ledger, hashed while
it is written, header last), then synced and renamed into place alone or as a group commit."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import torch

from worker.dataplane.buffers import host_view, is_aligned
from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.errors import TierFull, TierUnavailable
from worker.dataplane.tiers.base import PutResult
from worker.dataplane.tiers.disk.files import BlockFiles
from worker.dataplane.tiers.disk.folder_sync import sync_folder
from worker.dataplane.tiers.disk.gds import kvikio_write
from worker.dataplane.tiers.disk.headers import Stamp, header_of, pack_block_header

log = logging.getLogger(__name__)

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class _NoRoomYet(Exception):
    """No room for a block yet, while deleted blocks' files are being unlinked (`_stage` waits
    for them and writes once more)."""


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A block written to its temporary file, waiting to be synced and renamed."""

    key: uuid.UUID
    tmp: Path
    fd: int
    checksum: BlockChecksum
    io: str


class DiskWrites(BlockFiles):
    """`put` and `put_many` of the disk tier (see `writes`)."""

    def put(self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None) -> PutResult:
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
                    results = [self._io_error(exc, entry.tmp, "committing") for _, entry in ready]
                outcome: dict[int, PutResult | BaseException] = dict(zip([j for j, _ in ready], results, strict=True))
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
            # Hashed on the hasher's other thread while the bytes go to the file: the
            # header, which carries the checksum, is written last.
            hashing = self.hasher.run_async(self._spans(key, src, range(layout.layers)))
        else:
            self._check_layers(checksum)
        final = self.path_of(key)
        tmp = self._temp_path(final, key, self.file_bytes)
        direct = self.direct_io and not use_kvikio and is_aligned(src.data_ptr(), layout.block_bytes)
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
                kvikio_write(
                    self._kvikio, fd, tmp, header, src, header_bytes=self.header_bytes, file_bytes=self.file_bytes
                )
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
                    os.ftruncate(fd, self.file_bytes)  # pad, so O_DIRECT reads of the tail stay aligned
        except BaseException as exc:
            with contextlib.suppress(OSError):  # the write's own error is the one to report
                os.close(fd)
            self._abandon(tmp)
            raise self._io_error(exc, tmp, "writing", wait_for_freed=wait_for_freed) from exc
        return _Staged(
            key=key,
            tmp=tmp,
            fd=fd,
            checksum=checksum,
            io="kvikio" if use_kvikio else "direct" if direct else "buffered",
        )

    def _fill_header(self, view: memoryview, key: uuid.UUID, checksum: BlockChecksum) -> None:
        packed = pack_block_header(self.layout, key, checksum)
        view[: len(packed)] = packed
        view[len(packed) :] = bytes(self.header_bytes - len(packed))

    def _no_room(self, wait_for_freed: bool, *, free: int | None = None, detail: str = "") -> Exception:
        """The error for a block that does not fit: _NoRoomYet while waiting for freed bytes is
        still worth it (`_stage` retries), else TierFull, counted."""
        if wait_for_freed:
            return _NoRoomYet()
        self.counters.add(f"{self.name}.full")
        return TierFull(self.name, needed=self.file_bytes, free=free, detail=detail)

    def _io_error(self, exc: BaseException, path: Path, doing: str, *, wait_for_freed: bool = False) -> BaseException:
        """What a put reports for `exc` raised while `doing` `path`: TierFull for a full
        filesystem or quota (_NoRoomYet instead when `wait_for_freed`), TierUnavailable for any
        other I/O error (a failing disk, a shared mount gone stale: the caller keeps the block
        elsewhere or recomputes), both counted; anything else as it was raised. Every OSError of
        the write path goes through here: none leaves a put bare."""
        if not isinstance(exc, OSError):
            return exc
        error: BaseException
        if exc.errno in _FULL_ERRNOS:
            error = self._no_room(wait_for_freed, detail=f"{exc.strerror} {doing} {path.name}")
        else:
            error = self._unavailable(exc, path, doing)
        error.__cause__ = exc  # these errors travel through futures, not `raise ... from`
        return error

    def _unavailable(self, exc: OSError, path: Path, doing: str) -> TierUnavailable:
        """TierUnavailable (counted) for an I/O error `doing` `path`: the disk or the mount failing."""
        self.counters.add(f"{self.name}.unavailable")
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "OSError"
        error = TierUnavailable(self.name, reason=f"{doing} {path} failed: {code} ({exc.strerror or exc})")
        error.__cause__ = exc
        return error

    def _commit(self, staged: Sequence[_Staged]) -> list[PutResult | BaseException]:
        """fdatasync every staged file, rename them into place under one ledger lock, and hand
        their directories to the syncer (a crash before it syncs them can lose a rename `put`
        already reported: see FOLDER_SYNC_DELAY_S). Returns a PutResult or an error per block,
        in order; a block that fails leaves no temporary file and no reservation behind, and the
        others go on."""
        layout = self.layout
        results: list[PutResult | BaseException | None] = [None] * len(staged)
        synced: list[tuple[int, _Staged, Stamp]] = []
        for i, entry in enumerate(staged):
            try:
                try:
                    os.fdatasync(entry.fd)
                    if entry.io == "buffered":
                        os.posix_fadvise(entry.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    st = os.fstat(entry.fd)
                finally:
                    # A network filesystem may report a lost write only here: it fails the block.
                    os.close(entry.fd)
            except BaseException as exc:
                self._abandon(entry.tmp)
                results[i] = self._io_error(exc, entry.tmp, "syncing")
                continue
            synced.append((i, entry, Stamp(inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)))
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
                    results[i] = self._io_error(exc, self._ledger.path, "updating the ledger")
            placed = []
        if placed:
            self._syncer.add({self.path_of(entry.key).parent for _, entry, _stamp in placed})
        for i, entry, stamp in placed:
            if results[i] is not None:
                continue
            self._headers.remember(entry.key, stamp, header_of(layout, entry.key, entry.checksum))
            self.counters.add(f"{self.name}.io_{entry.io}")
            self.counters.add(f"{self.name}.puts")
            self.counters.add(f"{self.name}.bytes_written", layout.block_bytes)
            results[i] = PutResult(key=entry.key, tier=self.name, nbytes=layout.block_bytes, checksum=entry.checksum)
        return cast(list[PutResult | BaseException], results)

    def _rename_into_place(
        self,
        synced: Sequence[tuple[int, _Staged, Stamp]],
        results: list[PutResult | BaseException | None],
    ) -> list[tuple[int, _Staged, Stamp]]:
        """Rename the synced temporary files to their blocks' names under the ledger lock,
        moving each reservation to stored bytes; returns those renamed. A rename that fails
        sets `results[i]` and removes that temporary file and its reservation."""
        placed: list[tuple[int, _Staged, Stamp]] = []
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
                    results[i] = self._io_error(exc, entry.tmp, "renaming into place")
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

    def _reserve_and_create(self, tmp: Path, *, direct: bool, wait_for_freed: bool) -> tuple[int, Path]:
        """Reserve a block's room in the ledger and create its temporary file `tmp`, or take a
        kept file of a deleted block instead (REUSE_DELETED_S; it keeps its own temporary name):
        returns the open file and its name. TierFull when there is no room (_NoRoomYet instead
        when `wait_for_freed`), TierUnavailable when the disk fails (the ledger, the fan-out
        directory or the file)."""
        created: int | None = None
        try:
            with self._ledger.locked() as state:
                if tmp.parent not in self._dirs:
                    self._make_fanout(tmp.parent)
                    self._dirs.add(tmp.parent)
                reused = self._reuse_deleted(direct=direct)
                if reused is not None:
                    created, tmp = reused
                    return created, tmp
                used = state[0] + state[1]
                if used + self.file_bytes > self.capacity_bytes:
                    raise self._no_room(wait_for_freed, free=max(0, self.capacity_bytes - used))
                # Created under the ledger lock, so a reconcile never misses a live reservation.
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
                try:
                    created = os.open(tmp, flags, 0o644)
                except FileNotFoundError:  # someone removed the fan-out directory meanwhile
                    self._make_fanout(tmp.parent)
                    created = os.open(tmp, flags, 0o644)
                state[1] += self.file_bytes
                return created, tmp
        except OSError as exc:
            # The ledger could not record a file already open: it goes too (a reconcile, the
            # tier's next opening, recounts what the ledger missed).
            if created is not None:
                with contextlib.suppress(OSError):
                    os.close(created)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise self._io_error(exc, tmp, "creating", wait_for_freed=wait_for_freed) from exc

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
                log.warning("%s tier: reusing the deleted block file %s failed: %s", self.name, kept, exc)
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
        a tier's life). Should that sync fail, the put fails and the root is left to the
        background syncer (a later put finds the directory there and does not sync it)."""
        try:
            directory.mkdir()
        except FileExistsError:
            return
        try:
            sync_folder(self.root)
        except OSError:
            self._syncer.add([self.root])
            raise

    def _abandon(self, tmp: Path) -> None:
        """Remove a failed write's temporary file and its reservation. Called while reporting
        that failure, so it raises nothing: where the ledger fails too, the file still goes, its
        reservation stays counted until a reconcile (the tier's next opening) recounts it."""
        try:
            with self._ledger.locked() as state:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                state[1] -= self.file_bytes
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("%s tier: releasing the reservation of %s failed: %s", self.name, tmp.name, exc)
