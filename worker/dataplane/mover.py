"""Byte movement between a node's tiers: verified copies in waves, with reads running ahead.

A copy job names a block (its key), the tier it is read from, the tier it is written to and the
checksum the directory recorded for the source copy. The mover reads the source (verified: the
tier's read checks every byte), writes the target with the checksum just verified (no second
hash), then verifies the target (`full`: read it back; `header`: compare the checksum the target
stored). Each job's answer is a future of a `CopyResult`; the mover knows nothing of placements
or epochs, so whoever fences the copy decides what a result means for the directory.

Pipeline of one batch (`CopyBatch`), three threads: the reader fills one of `COPY_BUFFERS` block
buffers with block n+1 while the writer puts block n from the other and the verifier reads back
block n-1 into a buffer of its own, so the slower medium stays busy. A wave's jobs are numbered
across the batch; once a wave's last reads are under way, a freed buffer takes the first blocks
of the wave submitted after it (`NextWave`), so the pipeline does not drain between waves while
the caller does its own work between them. Where the target tier is written in place (the host
pool: `put_from`), the source is read straight into the target and the read is the write.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from worker.dataplane.config_values import VERIFY_MODES
from worker.dataplane.errors import BlockCorrupt, BlockMissing, TierFull
from worker.dataplane.tiers.base import ReadResult

if TYPE_CHECKING:
    from worker.dataplane.store import TieredStore

COPY_BUFFERS = 2
"""Block buffers a batch of copies cycles through: block n+1 is read from its source into one
while block n is written from the other (a third, per verifying thread, holds read-backs)."""


class CopyStatus(enum.StrEnum):
    DONE = "done"
    """The target holds a verified copy of the source's bytes."""
    NO_ROOM = "no-room"
    """The target tier is full: nothing was written."""
    SOURCE_CORRUPT = "source-corrupt"
    """The source copy is missing, damaged or not the bytes the directory recorded."""
    TARGET_CORRUPT = "target-corrupt"
    """The target copy failed verification after it was written."""
    FAILED = "failed"
    """An unexpected error (`CopyResult.error`), from the source read, the write or the check."""


@dataclasses.dataclass(frozen=True, slots=True)
class CopyJob:
    """One block to copy from tier `source` to tier `target`."""

    source: str
    target: str
    key: uuid.UUID
    expected: str = ""
    """The checksum (hex) recorded for the source copy; '' when none is recorded."""
    size: int = 0
    """The block's size in bytes, as recorded."""


@dataclasses.dataclass(frozen=True, slots=True)
class CopyResult:
    """What became of a copy job."""

    status: CopyStatus
    checksum: str = ""
    """The checksum (hex) of the source's bytes as read ('' when they were not read)."""
    written: bool = False
    """Bytes may exist under the target key (giving the target up must delete them)."""
    reason: str = ""
    """Why the copy is not DONE, in words."""
    error: BaseException | None = None
    """The unexpected error of a FAILED copy."""

    @property
    def done(self) -> bool:
        return self.status == CopyStatus.DONE


class _NothingToWrite(Exception):
    """A source read into a target written in place failed: the target is given back unwritten."""


class _Flight:
    """A copy job inside the pipeline: what happened to its bytes so far, and its future."""

    def __init__(self, job: CopyJob) -> None:
        self.job = job
        self.future: Future[CopyResult] = Future()
        self.checksum = ""
        self.written = False
        self.status = CopyStatus.DONE
        self.reason = ""
        self.error: BaseException | None = None
        self.in_place = False
        """The source was read straight into the target (`put_from`): the read was also the write."""

    @property
    def ok(self) -> bool:
        return self.status == CopyStatus.DONE

    def fail(self, status: CopyStatus, reason: str, error: BaseException | None = None) -> None:
        self.status, self.reason, self.error = status, reason, error

    def finish(self) -> None:
        if not self.future.done():
            self.future.set_result(
                CopyResult(
                    status=self.status,
                    checksum=self.checksum,
                    written=self.written,
                    reason=self.reason,
                    error=self.error,
                )
            )

    def abandon(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class NextWave:
    """The copies of the wave submitted after the one in transfer, numbered from `offset` across
    the batch: the running transfer reads ahead into them once its own last reads are under way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset = 0
        self._jobs: Sequence[_Flight] = ()

    def post(self, offset: int, jobs: Sequence[_Flight]) -> None:
        with self._lock:
            self._offset, self._jobs = offset, jobs

    def job(self, number: int) -> _Flight | None:
        with self._lock:
            index = number - self._offset
            return self._jobs[index] if 0 <= index < len(self._jobs) else None


class Mover:
    """Copies blocks between the tiers of one store; its threads start on first use."""

    def __init__(self, store: TieredStore, *, verify: str = "full", buffers: int = COPY_BUFFERS) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify: expected one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.store = store
        self.verify = verify
        self.buffers = max(1, buffers)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None
        self._verifiers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None

    def buffer(self, slot: str) -> Any:
        """The calling thread's block buffer named `slot` (made on first use)."""
        buffers = self._local.__dict__
        if slot not in buffers:
            buffers[slot] = self.store.layout.empty()
        return buffers[slot]

    def batch(self) -> CopyBatch:
        """A batch of waves sharing the pipeline; use it as a context manager."""
        return CopyBatch(self)

    def copy(self, jobs: Iterable[CopyJob]) -> list[Future[CopyResult]]:
        """Copy `jobs` as one batch of one wave and wait for all of them: every future is resolved."""
        with self.batch() as batch:
            return batch.submit(jobs)

    def make_durable(self, jobs: Sequence[CopyJob], results: Sequence[CopyResult]) -> list[CopyResult]:
        """Have each target tier make the verified copies written to it survive a crash of the
        machine (`Tier.sync`: the disk tier syncs the directories it renamed them into). Returns
        the results again, those of a tier that could not sync FAILED with its error."""
        written = [job.target for job, result in zip(jobs, results, strict=True) if result.done and result.written]
        broken: dict[str, BaseException] = {}
        for tier in sorted(set(written)):
            try:
                self.store.tier(tier).sync()
            except Exception as exc:  # noqa: BLE001 - handed back, job by job
                broken[tier] = exc
        return [
            dataclasses.replace(
                result, status=CopyStatus.FAILED, reason=f"{type(error).__name__}: {error}", error=error
            )
            if result.done and result.written and (error := broken.get(job.target)) is not None
            else result
            for job, result in zip(jobs, results, strict=True)
        ]

    def close(self) -> None:
        """Stop the threads (after the copies already handed to them)."""
        with self._lock:
            pools, self._readers, self._verifiers, self._writers = (
                (self._readers, self._verifiers, self._writers),
                None,
                None,
                None,
            )
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    # -- the pipeline -----------------------------------------------------------------------
    def _threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor, ThreadPoolExecutor]:
        """The thread writing targets, the one reading sources and the one verifying targets."""
        with self._lock:
            if self._writers is None or self._readers is None or self._verifiers is None:
                self._writers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-write")
                self._readers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-read")
                self._verifiers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-verify")
            return self._writers, self._readers, self._verifiers

    def _transfer(self, batch: CopyBatch, flights: Sequence[_Flight], offset: int) -> None:
        """Copy the blocks of a wave (on the writer thread): block n+1 is read (reader thread)
        while block n is written (this thread) and block n-1 verified (verifier thread). Copies
        are numbered across the batch from `offset`; the reads the previous wave started for this
        one are taken over, and this wave's reads ahead into the next are left for it. Returns once
        every put returned: the last verifications go on, each resolving its job's future."""
        _, readers, verifiers = self._threads()
        buffers = [self.buffer(f"copy-{i}") for i in range(self.buffers)]
        reads: dict[int, Future[ReadResult | None]] = batch.take_read_ahead()
        ahead: dict[int, Future[ReadResult | None]] = {}
        for i in range(min(self.buffers, len(flights))):
            if offset + i not in reads:
                reads[offset + i] = readers.submit(self._copy_source, flights[i], buffers[(offset + i) % self.buffers])
        try:
            for i, flight in enumerate(flights):
                number = offset + i
                buffer = buffers[number % self.buffers]
                read = reads.pop(number).result()
                if read is not None and not flight.in_place:
                    target = self.store.tier(flight.job.target)
                    self._write_target(flight, partial(target.put, flight.job.key, buffer, checksum=read.checksum))
                # The buffer is free again once the put returned.
                following = number + self.buffers
                if i + self.buffers < len(flights):
                    reads[following] = readers.submit(self._copy_source, flights[i + self.buffers], buffer)
                elif (next_flight := batch.next_wave.job(following)) is not None:
                    ahead[following] = readers.submit(self._copy_source, next_flight, buffer)
                if read is not None and flight.written and flight.ok:
                    verifiers.submit(self._check_target, flight)  # reads into its own buffer, then resolves
                else:
                    flight.finish()
        except BaseException as exc:
            for future in ahead.values():
                future.exception()
            for flight in flights:
                flight.abandon(exc)
            raise
        finally:
            for future in reads.values():
                future.exception()  # never leave a thread writing into a copy buffer after returning
        batch.leave_read_ahead(ahead)

    def _copy_source(self, flight: _Flight, buffer: Any) -> ReadResult | None:
        """A job's read: into `buffer`, for the writer to put into the target; or, where the target
        tier is written in place (`Tier.writes_in_place`), straight into the target, which that
        also writes (the block's bytes cross memory once instead of twice). None (and the flight
        says why) when there is nothing to write."""
        target = self.store.tier(flight.job.target)
        if not target.writes_in_place:
            return self._read_source(flight, buffer)
        flight.in_place = True
        reads: list[ReadResult] = []

        def fill(into: Any) -> Any:
            read = self._read_source(flight, into)
            if read is None:
                raise _NothingToWrite  # the flight says why
            reads.append(read)
            return read.checksum

        self._write_target(flight, partial(target.put_from, flight.job.key, fill))
        return reads[0] if flight.written and flight.ok else None

    def _read_source(self, flight: _Flight, buffer: Any) -> ReadResult | None:
        """Verified read of the source copy into `buffer`; None (and the flight says why) on failure."""
        job = flight.job
        try:
            read = self.store.tier(job.source).get(job.key, buffer)
        except (BlockCorrupt, BlockMissing) as exc:
            flight.fail(CopyStatus.SOURCE_CORRUPT, f"source copy unreadable, quarantined: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - handed back in the result
            flight.fail(CopyStatus.FAILED, f"{type(exc).__name__}: {exc}", exc)
            return None
        flight.checksum = read.checksum.hex if read.checksum is not None else ""
        if job.expected and flight.checksum != job.expected:
            flight.fail(
                CopyStatus.SOURCE_CORRUPT,
                f"source copy's checksum {flight.checksum} is not the recorded {job.expected}; quarantined",
            )
            return None
        return read

    def _write_target(self, flight: _Flight, write: Callable[[], object]) -> None:
        """Run the put of a job's target copy (`write`); the flight records what became of it."""
        try:
            write()
        except _NothingToWrite:  # an in-place put whose source read failed: the flight says why
            return
        except TierFull as exc:
            flight.fail(CopyStatus.NO_ROOM, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - handed back in the result
            flight.written = True
            flight.fail(CopyStatus.FAILED, f"{type(exc).__name__}: {exc}", exc)
            return
        flight.written = True

    def _check_target(self, flight: _Flight) -> None:
        """Verify a written target (on the verifier thread), then resolve the job's future."""
        try:
            problem = self.target_problem(flight.job.target, flight.job.key, flight.job.expected or flight.checksum)
        except Exception as exc:  # noqa: BLE001 - handed back in the result
            flight.fail(CopyStatus.FAILED, f"{type(exc).__name__}: {exc}", exc)
        else:
            if problem:
                flight.fail(CopyStatus.TARGET_CORRUPT, problem)
        finally:
            flight.finish()

    def target_problem(self, tier: str, key: uuid.UUID, expected: str) -> str:
        """'' when the copy of `key` in `tier` carries the `expected` checksum (and, verifying
        fully, every byte of it passes); otherwise what is wrong."""
        try:
            if self.verify == "full":
                read = self.store.tier(tier).get(key, self.buffer("verify"))
                got = read.checksum.hex if read.checksum is not None else ""
            else:
                stored = self.store.tier(tier).checksum(key)
                if stored is None:
                    stored = self.store.tier(tier).get(key, self.buffer("verify")).checksum
                got = stored.hex if stored is not None else ""
        except (BlockCorrupt, BlockMissing) as exc:
            return f"the target copy failed verification: {exc}"
        if got != expected:
            return f"the target copy's checksum {got} is not the source's {expected}"
        return ""


class CopyBatch:
    """Waves of copies that share one pipeline: reads of a wave start while the wave before it is
    still being written. Waves run in the order they are submitted. Leaving the `with` block waits
    for every copy handed over; leaving it on an error first cancels the waves not yet started."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self.next_wave = NextWave()
        self._count = 0  # copies submitted so far: copy n uses buffer n % buffers
        self._transfers: list[Future[None]] = []
        self._flights: list[_Flight] = []
        self._read_ahead: dict[int, Future[ReadResult | None]] = {}
        self._cancelled = False

    def __enter__(self) -> CopyBatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(cancel=exc is not None)

    def submit(self, jobs: Iterable[CopyJob]) -> list[Future[CopyResult]]:
        """Queue a wave; one future per job, in order, each resolved once its copy is verified or
        has failed (an unexpected error of the pipeline itself is the future's exception)."""
        flights = [_Flight(job) for job in jobs]
        offset = self._count
        self.next_wave.post(offset, flights)  # the running transfer may start reading them
        if flights:
            writers, _, _ = self.mover._threads()
            self._flights.extend(flights)
            self._transfers.append(writers.submit(self._run_wave, flights, offset))
            self._count += len(flights)
        return [flight.future for flight in flights]

    def _run_wave(self, flights: Sequence[_Flight], offset: int) -> None:
        if self._cancelled:
            for flight in flights:
                flight.abandon(CancelledError())
            return
        try:
            self.mover._transfer(self, flights, offset)
        except BaseException:
            self._cancelled = True  # a broken pipeline copies nothing more of the batch
            raise

    def take_read_ahead(self) -> dict[int, Future[ReadResult | None]]:
        """The reads the previous wave started for the next one (on the writer thread)."""
        reads, self._read_ahead = self._read_ahead, {}
        return reads

    def leave_read_ahead(self, reads: dict[int, Future[ReadResult | None]]) -> None:
        self._read_ahead = reads

    def close(self, *, cancel: bool = False) -> None:
        """Wait for every wave, read and verification of the batch; with `cancel`, waves not yet
        started fail their jobs instead of copying."""
        if cancel:
            self._cancelled = True
        for transfer in self._transfers:
            transfer.exception()  # never leave with a copy still running
        for read in self.take_read_ahead().values():
            read.exception()  # nor with a read of a copy never made
        for flight in self._flights:
            flight.future.exception()  # nor with a verification still reading
        self._transfers.clear()
