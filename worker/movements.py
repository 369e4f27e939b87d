"""The node's side of movements: execute moves, evictions and warm-ups against the node's tiered
store under the directory's epoch fencing, scrub copies and reconcile bytes with placements.

Every step is safe to run twice. A move copies the block to a reserved (PENDING) target, verifies
the copy, then flips target READY and source DELETING in one transaction guarded by both epochs;
only then are the source bytes freed. A worker that dies anywhere leaves either the old copy
READY (before the flip) or the new one (after it); its task is delivered again and resumes from
what the directory says. A flip refused by an epoch means someone else changed the block: the
worker drops its own target (only while the target is still its own) and never serves it.

Fault injection for tests: STRATA_FAULT_POINT=after-copy|after-flip|after-reserve makes the
worker log "fault injection: ..." and hold at that point for STRATA_FAULT_HOLD_S seconds (default
3600) so a test can SIGKILL or SIGSTOP the real process there. Unset, it does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)

from controlplane.directory.choices import PlacementState, Tier
from controlplane.directory.errors import InvalidTransition, PlacementNotFound, StaleEpoch
from controlplane.directory.models import Block, Node, Placement
from controlplane.directory.services import (
    PendingCopy,
    PlacementFlip,
    placement_delete,
    placement_mark_corrupt,
    placement_mark_deleting,
    placements_create_pending_many,
    placements_delete_many,
    placements_flip_many,
)
from controlplane.movements.choices import MovementKind, MovementState
from controlplane.movements.models import Movement
from controlplane.movements.services import (
    MovementResult,
    checksum_failures_count,
    movement_start,
    movements_finish_many,
    movements_finished_announce,
    movements_set_targets,
    movements_start_many,
)
from worker.dataplane.errors import BlockCorrupt, BlockMissing, TierFull, TierUnavailable
from worker.dataplane.tiers.base import ReadResult

log = logging.getLogger("strata.movements")

FAULT_POINTS = ("after-reserve", "after-copy", "after-flip")
VERIFY_MODES = ("full", "header")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError, TierUnavailable,
                                                     ConnectionError, TimeoutError)
"""Errors after which the same task may succeed later (database or Redis away): the task retries."""

_FENCED = (StaleEpoch, InvalidTransition, PlacementNotFound)

WAVE_BYTES = 128 << 20
"""Blocks of a batch are reserved, copied and flipped in waves of about this many bytes (at least
one block): big enough that a wave's I/O covers the next wave's database work with room to spare
on a busy node (a wave costs three commits and about a dozen statements whatever its size). The
copy pipeline runs on across waves when the next wave is reserved before this one's last reads
(`_Upcoming`). `_waves` keeps the first and the last wave to one block."""

COPY_BUFFERS = 2
"""Block buffers a batch of copies cycles through: block n+1 is read from its source into one
while block n is written from the other (a third, per verifying thread, holds read-backs)."""


def _waves(ids: Sequence[int], per_wave: int) -> list[Sequence[int]]:
    """`ids` in waves of `per_wave`, except that the first and the last wave hold one block each
    (when there are more than two waves' worth): nothing overlaps the first wave's reservation
    or the last wave's flip and conclusion, so the smaller they are, the less the batch waits
    on them (with the bulk services a wave's database work is a few statements whatever its size;
    it was ~10 ms per movement one by one)."""
    if per_wave <= 1 or len(ids) <= 2 * per_wave:
        return [ids[start:start + per_wave] for start in range(0, len(ids), per_wave)]
    middle = ids[1:-1]
    return [ids[:1], *(middle[start:start + per_wave] for start in range(0, len(middle), per_wave)), ids[-1:]]


class _Upcoming:
    """The copies of the wave after the one in transfer, posted by the batch's thread once
    reserved, numbered from `offset` across the batch (`_transfer` reads ahead into them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset = 0
        self._jobs: Sequence[_Copy] = ()

    def post(self, offset: int, jobs: Sequence[_Copy]) -> None:
        with self._lock:
            self._offset, self._jobs = offset, jobs

    def job(self, number: int) -> _Copy | None:
        with self._lock:
            index = number - self._offset
            return self._jobs[index] if 0 <= index < len(self._jobs) else None


@dataclasses.dataclass(frozen=True)
class MovementOptions:
    """How the node executes movements, from STRATA_* variables (read once, validated)."""

    verify: str = "full"
    """full: read the target copy back and verify every byte before the flip; header: compare the
    checksum the target tier stored with the source's (every later read still verifies bytes)."""
    fault_point: str = ""
    fault_hold_s: float = 3600.0
    reconcile_grace_s: float = 300.0
    """Bytes without a placement are deleted only when a reconcile at least this long ago saw
    them orphaned too: an engine's write-back registers its blocks a moment after writing them."""
    scrub_batch: int = 64

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> MovementOptions:
        env = os.environ if environ is None else environ
        verify = env.get("STRATA_MOVE_VERIFY", "full")
        if verify not in VERIFY_MODES:
            raise ValueError(f"STRATA_MOVE_VERIFY: expected one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        fault = env.get("STRATA_FAULT_POINT", "")
        if fault and fault not in FAULT_POINTS:
            raise ValueError(f"STRATA_FAULT_POINT: expected one of {', '.join(FAULT_POINTS)}, got {fault!r}")
        numbers = {}
        for name, default in (("STRATA_FAULT_HOLD_S", 3600.0), ("STRATA_RECONCILE_GRACE_S", 300.0)):
            raw = env.get(name, str(default))
            try:
                numbers[name] = float(raw)
            except ValueError:
                raise ValueError(f"{name}: expected a number of seconds, got {raw!r}") from None
            if numbers[name] < 0:
                raise ValueError(f"{name}: cannot be negative")
        return cls(verify=verify, fault_point=fault, fault_hold_s=numbers["STRATA_FAULT_HOLD_S"],
                   reconcile_grace_s=numbers["STRATA_RECONCILE_GRACE_S"])


class _NothingToWrite(Exception):
    """A source read into a target written in place failed: the target is given back unwritten."""


class NoStore(RuntimeError):
    """The node serves no model, so it has no tiered store to move bytes with."""


_Ended = tuple[Movement, MovementResult]
"""A movement and the result to record for it (`MovementExecutor._record` records a wave's at once)."""


@dataclasses.dataclass(frozen=True)
class _Reservation:
    """A started movement whose source checked out: its target copy is still to be reserved."""

    movement: Movement
    block: Block
    source: Placement
    previous: Placement | None
    """The target an earlier attempt of this movement reserved (taken over if still pending)."""
    free_source: bool
    started: float


@dataclasses.dataclass
class _Copy:
    """One move or warm-up of a batch, from its reserved target to its flip; the copy stage
    fills in what happened to the bytes, the conclusion turns that into directory changes."""

    movement: Movement
    block: Block
    key: uuid.UUID
    source: Placement
    target: Placement
    free_source: bool
    started: float
    checksum_hex: str = ""
    written: bool = False
    """Bytes may exist under the target (dropping the target must delete them)."""
    failure: str = ""
    """Why the copy cannot be flipped ('' while it can)."""
    source_bad: bool = False
    target_bad: bool = False
    error: BaseException | None = None
    """An unexpected error (a transient one makes the task retry the batch)."""
    check: Future[None] | None = None
    """The verification of the target, still running when the wave's writes are done: the next
    wave's copies start meanwhile, and the conclusion waits for it before anything is flipped."""
    in_place: bool = False
    """The source was read straight into the target (a tier written in place: `put_from`), so
    the read was also the write."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    movement_id: int
    state: str
    """The movement's state after this run (`skipped` when it had finished before)."""
    detail: str = ""


@dataclasses.dataclass
class ScrubReport:
    tier: str
    checked: int = 0
    corrupt: int = 0
    missing: int = 0


@dataclasses.dataclass
class ReconcileReport:
    tier: str
    orphans_seen: int = 0
    orphans_deleted: int = 0
    missing_marked: int = 0


class _Announcer:
    """Sums finished movements and sends one dashboard event per node at most every `every_s`."""

    def __init__(self, node: str, every_s: float = 1.0) -> None:
        self.node = node
        self.every_s = every_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._routes: Counter[str] = Counter()
        self._sent_at = 0.0
        self._timer: threading.Timer | None = None

    def add(self, *movements: Movement) -> None:
        with self._lock:
            for movement in movements:
                self._counts[movement.state] += 1
                if movement.state == MovementState.DONE:
                    self._counts["bytes"] += movement.bytes
                    self._routes[movement.route] += 1
            due = time.monotonic() - self._sent_at >= self.every_s
            if not due and self._timer is None:
                self._timer = threading.Timer(self.every_s, self._flush_later)
                self._timer.daemon = True
                self._timer.start()
        if due:
            self.flush()

    def _flush_later(self) -> None:
        try:
            self.flush()
        finally:
            connection.close()  # this timer thread's own database connection

    def flush(self) -> None:
        with self._lock:
            counts, routes = self._counts, self._routes
            self._counts, self._routes = Counter(), Counter()
            self._sent_at = time.monotonic()
            self._timer = None
        if not counts:
            return
        try:
            movements_finished_announce(node=self.node, done=counts["done"], failed=counts["failed"],
                                        cancelled=counts["cancelled"], nbytes=counts["bytes"], routes=dict(routes))
        except Exception as exc:  # noqa: BLE001 - the dashboard stream is lossy by design
            log.warning("movement event not sent: %s", exc)


class MovementExecutor:
    """Executes one node's movements, scrubs and reconciles against its store."""

    def __init__(self, *, node: str, store: Any, options: MovementOptions | None = None) -> None:
        self.node = node
        self.store = store
        self.options = options or MovementOptions.from_environ()
        self.announcer = _Announcer(node)
        self._buffers = threading.local()
        self._orphans: dict[tuple[str, uuid.UUID], float] = {}
        self._orphans_lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None
        self._verifiers: ThreadPoolExecutor | None = None
        self._movers: ThreadPoolExecutor | None = None
        if self.options.fault_point:
            log.warning("fault injection armed: movements on node %s will hold at %s (STRATA_FAULT_POINT)",
                        node, self.options.fault_point)

    # -- plumbing ---------------------------------------------------------------------------
    def _buffer(self, slot: str) -> Any:
        buffers = self._buffers.__dict__
        if slot not in buffers:
            buffers[slot] = self.store.layout.empty()
        return buffers[slot]

    def _fault(self, point: str, *movements: Movement) -> None:
        """Hold every movement of a batch at `point` together (one sleep for the batch)."""
        if self.options.fault_point != point or not movements:
            return
        for movement in movements:
            log.warning("fault injection: movement %d (block %d) held at %s for %.0f s; pid %d",
                        movement.id, movement.block_id, point, self.options.fault_hold_s, os.getpid())
        time.sleep(self.options.fault_hold_s)
        for movement in movements:
            log.warning("fault injection: movement %d resumes after %s", movement.id, point)

    def _io_threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The thread reading sources and the thread verifying targets, started on first use."""
        if self._readers is None or self._verifiers is None:
            self._readers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-read")
            self._verifiers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-verify")
        return self._readers, self._verifiers

    def _mover(self) -> ThreadPoolExecutor:
        """The thread running a wave's copy pipeline (it writes the targets), started on first use."""
        if self._movers is None:
            self._movers = ThreadPoolExecutor(1, thread_name_prefix="strata-move-write")
        return self._movers

    @staticmethod
    def _ended(movement: Movement, state: str, *, started: float, detail: str = "", error: str = "",
               nbytes: int | None = None) -> _Ended:
        """The result of a movement that ended now (its duration counted from `started`)."""
        return movement, MovementResult(movement_id=movement.id, state=state, nbytes=nbytes,
                                        duration_s=time.perf_counter() - started, detail=detail, error=error)

    def _record(self, ended: Sequence[_Ended]) -> dict[int, Outcome]:
        """Record results in the ledger and the tallies, one statement for all of them
        (`movements_finish_many`); a movement finished meanwhile by another attempt is skipped."""
        if not ended:
            return {}
        rows = movements_finish_many(results=[result for _, result in ended])
        outcomes: dict[int, Outcome] = {}
        for (movement, result), finished in zip(ended, rows, strict=True):
            if finished is None:
                outcomes[movement.id] = Outcome(movement.id, "skipped", "finished elsewhere")
                continue
            line = f"movement {movement.id} ({movement.kind} block {movement.block_id} {movement.route}): {result.state}"
            if result.state == MovementState.DONE:
                log.info("%s, %d bytes in %.3f s", line, finished.bytes, finished.duration_s or 0.0)
            else:
                log.warning("%s: %s", line, result.error or result.detail)
            outcomes[movement.id] = Outcome(movement.id, result.state, result.error or result.detail)
        recorded = [finished for finished in rows if finished is not None]
        if recorded:
            # Inside a batch's transaction the dashboard hears of them only once it is committed.
            transaction.on_commit(lambda: self.announcer.add(*recorded))
        return outcomes

    def _finish(self, movement: Movement, state: str, *, started: float, detail: str = "", error: str = "",
                nbytes: int | None = None) -> Outcome:
        ended = self._ended(movement, state, started=started, detail=detail, error=error, nbytes=nbytes)
        return self._record([ended])[movement.id]

    def run(self, kind: str, movement_ids: Sequence[int]) -> list[Outcome]:
        """Execute a batch of movements of one kind, in order. Transient errors (database or
        Redis away) propagate, so the task retries the batch; finished ones are then skipped."""
        if kind in (MovementKind.MOVE, MovementKind.WARM):
            return self._run_copies(kind, movement_ids)
        step: Callable[[Movement], Outcome] = {MovementKind.EVICT: self._evict}[kind]  # type: ignore[index]
        outcomes = []
        for ident in movement_ids:
            movement = movement_start(movement_id=ident, node=self.node)
            if movement is None:
                outcomes.append(Outcome(ident, "skipped", "already finished"))
                continue
            if movement.kind != kind:
                outcomes.append(self._finish(movement, MovementState.FAILED, started=time.perf_counter(),
                                             error=f"kind: sent as {kind} but planned as {movement.kind}"))
                continue
            started = time.perf_counter()
            try:
                if self.store is None:
                    raise NoStore(f"node {self.node} serves no model: it has no tiered store to move bytes with")
                outcomes.append(step(movement))
            except TRANSIENT_ERRORS:
                raise
            except NoStore as exc:
                outcomes.append(self._finish(movement, MovementState.FAILED, started=started, error=str(exc)))
            except Exception as exc:  # noqa: BLE001 - recorded in the ledger, then the batch goes on
                log.exception("movement %d failed", movement.id)
                outcomes.append(self._finish(movement, MovementState.FAILED, started=started,
                                             error=f"{type(exc).__name__}: {exc}"))
        return outcomes

    # -- checks -----------------------------------------------------------------------------
    def _block(self, movement: Movement) -> Block | None:
        return Block.objects.filter(id=movement.block_id).only("id", "prefix_key", "size_bytes").first()

    def _layout_problem(self, block: Block, *tiers: str) -> str:
        for tier in tiers:
            if tier not in self.store.names:
                return f"tier: node {self.node} has no {tier} tier (it has {', '.join(self.store.names)})"
        if block.size_bytes != self.store.layout.block_bytes:
            return (f"block {block.id} is {block.size_bytes} bytes but this node's model stores "
                    f"{self.store.layout.block_bytes}-byte blocks: it belongs to another model")
        return ""

    # -- moves and warm-ups -------------------------------------------------------------------
    def _run_copies(self, kind: str, movement_ids: Sequence[int]) -> list[Outcome]:
        """Moves and warm-ups of a batch, in waves of about WAVE_BYTES (`_waves`). Each wave costs three
        database commits instead of six per movement (each commit waits for PostgreSQL's WAL to
        reach its disk) and about a dozen statements whatever its size (the bulk services; one by
        one it was ~30 per movement): one commit starts its movements and reserves their targets,
        one flips the verified copies, one frees the sources and records the results. While one
        wave's bytes flow through the copy pipeline (`_transfer`, on the mover thread), this thread reserves
        the next wave and concludes the previous one, so the database work hides behind the
        I/O. Each commit still comes before the step it guards: a target is reserved before its
        bytes are written, a flip is durable before its source is freed."""
        ids = list(dict.fromkeys(movement_ids))
        per_wave = max(1, WAVE_BYTES // self.store.layout.block_bytes) if self.store is not None else len(ids)
        outcomes: dict[int, Outcome] = {}
        copying: list[_Copy] = []
        transfer: Future[dict[int, Future[ReadResult | None]]] | None = None
        upcoming = _Upcoming()
        prefetched: dict[int, Future[ReadResult | None]] = {}
        offset = 0  # the batch's running count of copies: copy n uses buffer n % COPY_BUFFERS
        try:
            for wave in _waves(ids, per_wave):
                jobs = self._start_wave(kind, wave, outcomes)
                upcoming.post(offset, jobs)  # the running transfer may start reading them
                if transfer is not None:
                    prefetched = transfer.result()
                    transfer = None
                copied, copying = copying, jobs
                if jobs:
                    self._fault("after-reserve", *(job.movement for job in jobs))
                    transfer = self._mover().submit(self._transfer, jobs, offset, prefetched, upcoming)
                    prefetched = {}
                    offset += len(jobs)
                if copied:
                    outcomes.update(self._conclude(copied))
            if transfer is not None:
                prefetched = transfer.result()
                transfer = None
            if copying:
                outcomes.update(self._conclude(copying))
        finally:
            if transfer is not None:  # leaving on an error: never with a copy still running
                transfer.exception()
            for read in prefetched.values():  # nor with a read of a copy never made
                read.exception()
            for job in copying:  # nor with a verification still reading
                if job.check is not None:
                    job.check.exception()
        return [outcomes[ident] for ident in movement_ids]

    def _start_wave(self, kind: str, ids: Sequence[int], outcomes: dict[int, Outcome]) -> list[_Copy]:
        """One transaction of a few statements, whatever the wave's size: start its movements
        (`movements_start_many`), read their blocks and copies, check each against the directory,
        reserve the targets of the ones to copy (`placements_create_pending_many`) and record the
        results of the others (`movements_finish_many`). Each movement is still judged on its own:
        a stale source cancels only its movement. Returns the copies to make; the other
        movements' outcomes go into `outcomes`."""
        with transaction.atomic():
            started = time.perf_counter()
            ended: list[_Ended] = []
            checked: list[Movement] = []
            for ident, movement in zip(ids, movements_start_many(movement_ids=ids, node=self.node), strict=True):
                if movement is None:
                    outcomes[ident] = Outcome(ident, "skipped", "already finished")
                elif movement.kind != kind:
                    ended.append(self._ended(movement, MovementState.FAILED, started=started,
                                             error=f"kind: sent as {kind} but planned as {movement.kind}"))
                elif self.store is None:
                    ended.append(self._ended(movement, MovementState.FAILED, started=started,
                                             error=f"node {self.node} serves no model: it has no tiered store to "
                                                   "move bytes with"))
                else:
                    checked.append(movement)
            blocks = Block.objects.only("id", "prefix_key", "size_bytes").in_bulk([m.block_id for m in checked])
            copies = Placement.objects.in_bulk([m.src_placement_id for m in checked]
                                               + [m.dst_placement_id for m in checked if m.dst_placement_id])
            wanted: list[_Reservation] = []
            for movement in checked:
                try:
                    prepared = self._prepare(movement, block=blocks.get(movement.block_id),
                                             source=copies.get(movement.src_placement_id),
                                             target=copies.get(movement.dst_placement_id or 0),
                                             free_source=kind == MovementKind.MOVE, started=started)
                except TRANSIENT_ERRORS:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded in the ledger, then the wave goes on
                    log.exception("movement %d failed", movement.id)
                    ended.append(self._ended(movement, MovementState.FAILED, started=started,
                                             error=f"{type(exc).__name__}: {exc}"))
                    continue
                if isinstance(prepared, _Reservation):
                    wanted.append(prepared)
                else:
                    ended.append(prepared)
            jobs, refused = self._reserve(wanted)
            outcomes.update(self._record([*ended, *refused]))
        return jobs

    def _prepare(self, movement: Movement, *, block: Block | None, source: Placement | None,
                 target: Placement | None, free_source: bool, started: float) -> _Reservation | _Ended:
        """Check a started movement against its block and copies as the wave read them: the target
        to reserve, or the movement's result when there is nothing to copy (resumed, changed,
        gone). The rare paths that change the directory here each run in a savepoint of their own."""
        if block is None:
            with transaction.atomic():
                self._drop_target(movement, block_key=None)
            return self._ended(movement, MovementState.CANCELLED, started=started, detail="the block was purged")
        problem = self._layout_problem(block, movement.src_tier, movement.dst_tier)
        if problem:
            return self._ended(movement, MovementState.FAILED, started=started, error=problem)
        key = block.prefix_key
        if free_source and target is not None and target.state == PlacementState.READY and (
                source is None or (source.state == PlacementState.DELETING
                                   and source.epoch == movement.src_epoch + 1)):
            # A previous attempt flipped and died before freeing the source: finish its work.
            with transaction.atomic():
                self._free(source, movement, key)
            return self._ended(movement, MovementState.DONE, started=started, nbytes=target.size_bytes,
                               detail="resumed after the flip")
        if not free_source and target is not None and target.state == PlacementState.READY:
            return self._ended(movement, MovementState.DONE, started=started, nbytes=target.size_bytes,
                               detail="resumed: the warm copy was ready")
        if source is None or source.state != PlacementState.READY or source.epoch != movement.src_epoch:
            with transaction.atomic():
                self._drop_target(movement, block_key=key)
            now = "gone" if source is None else f"{source.state} at epoch {source.epoch}"
            return self._ended(movement, MovementState.CANCELLED, started=started,
                               detail=f"the source copy changed since planning (now {now}, "
                                      f"planned at epoch {movement.src_epoch})")
        return _Reservation(movement=movement, block=block, source=source, previous=target, free_source=free_source,
                            started=started)

    def _transfer(self, jobs: Sequence[_Copy], offset: int, prefetched: dict[int, Future[ReadResult | None]],
                  upcoming: _Upcoming) -> dict[int, Future[ReadResult | None]]:
        """Copy the blocks of a wave: a verified read from the source, a put into the target
        carrying the checksum just verified (no second hash), a verification of the target.
        Block n+1 is read (reader thread) while block n is written (this thread) and block n-1
        is verified (verifier thread), so the slower medium is kept busy. Copies are numbered
        across the batch from `offset`; `prefetched` holds the reads the previous wave started
        for this one. Once this wave's last reads are under way, a freed buffer takes the first
        blocks of the next wave if the batch has posted it (`upcoming`), so the pipeline does not
        drain between waves; those reads are returned for the next wave. Returns once every put
        returned: the last verifications go on (`job.check`). No database work here: what
        happened is recorded on each job."""
        readers, verifiers = self._io_threads()
        buffers = [self._buffer(f"copy-{i}") for i in range(COPY_BUFFERS)]
        reads: dict[int, Future[ReadResult | None]] = dict(prefetched)
        ahead: dict[int, Future[ReadResult | None]] = {}
        for i in range(min(COPY_BUFFERS, len(jobs))):
            if offset + i not in reads:
                reads[offset + i] = readers.submit(self._copy_source, jobs[i], buffers[(offset + i) % COPY_BUFFERS])
        try:
            for i, job in enumerate(jobs):
                number = offset + i
                buffer = buffers[number % COPY_BUFFERS]
                read = reads.pop(number).result()
                if read is not None and not job.in_place:
                    target = self.store.tier(job.movement.dst_tier)
                    self._write_target(job, partial(target.put, job.key, buffer, checksum=read.checksum))
                # The buffer is free again once the put returned.
                following = number + COPY_BUFFERS
                if i + COPY_BUFFERS < len(jobs):
                    reads[following] = readers.submit(self._copy_source, jobs[i + COPY_BUFFERS], buffer)
                elif (next_job := upcoming.job(following)) is not None:
                    ahead[following] = readers.submit(self._copy_source, next_job, buffer)
                if read is not None and job.written and not job.failure and job.error is None:
                    job.check = verifiers.submit(self._check_target, job)  # reads into its own buffer
        except BaseException:
            for future in ahead.values():
                future.exception()
            raise
        finally:
            for future in reads.values():
                future.exception()  # never leave a thread writing into a copy buffer after returning
        return ahead

    def _copy_source(self, job: _Copy, buffer: Any) -> ReadResult | None:
        """The copy stage's read of a job: into `buffer`, for the transfer to write to the target;
        or, where the target tier is written in place (the host pool: `put_from`), straight into
        the target, which that also writes (`job.in_place`; the block's bytes cross memory once
        instead of twice). None (and the job says why) when there is nothing to write."""
        target = self.store.tier(job.movement.dst_tier)
        if not target.writes_in_place:
            return self._read_source(job, buffer)
        job.in_place = True
        reads: list[ReadResult] = []

        def fill(target: Any) -> Any:
            read = self._read_source(job, target)
            if read is None:
                raise _NothingToWrite  # the job says why
            reads.append(read)
            return read.checksum

        self._write_target(job, partial(target.put_from, job.key, fill))
        return reads[0] if job.written and job.error is None else None

    def _read_source(self, job: _Copy, buffer: Any) -> ReadResult | None:
        """Verified read of the source copy into `buffer`; None (and the job says why) on failure."""
        movement = job.movement
        try:
            read = self.store.tier(movement.src_tier).get(job.key, buffer)
        except (BlockCorrupt, BlockMissing) as exc:
            job.failure, job.source_bad = f"source copy unreadable, quarantined: {exc}", True
            return None
        except Exception as exc:  # noqa: BLE001 - handed to the conclusion
            job.error = exc
            return None
        job.checksum_hex = read.checksum.hex if read.checksum is not None else ""
        if job.source.checksum and job.checksum_hex != job.source.checksum:
            job.failure = (f"source copy's checksum {job.checksum_hex} is not the recorded "
                           f"{job.source.checksum}; quarantined")
            job.source_bad = True
            return None
        return read

    def _write_target(self, job: _Copy, write: Callable[[], object]) -> None:
        """Run the put of a job's target copy (`write`); the job records what became of it."""
        try:
            write()
        except _NothingToWrite:  # an in-place put whose source read failed: the job says why
            return
        except TierFull as exc:
            job.failure = str(exc)
            return
        except Exception as exc:  # noqa: BLE001 - handed to the conclusion
            job.error, job.written = exc, True
            return
        job.written = True

    def _check_target(self, job: _Copy) -> None:
        try:
            problem = self._verify_target(job.movement.dst_tier, job.key, job.source.checksum or job.checksum_hex)
        except Exception as exc:  # noqa: BLE001 - handed to the conclusion
            job.error = exc
            return
        if problem:
            job.failure, job.target_bad = problem, True

    def _conclude(self, jobs: Sequence[_Copy]) -> dict[int, Outcome]:
        """Turn the copies into directory changes: failed ones are cleaned up one by one and their
        results recorded together; the verified ones are flipped in one transaction (a warm-up's
        result recorded in it), the moves' sources freed and their results recorded in another. A
        transient error is raised after the rest is concluded."""
        outcomes: dict[int, Outcome] = {}
        transient: BaseException | None = None
        verified: list[_Copy] = []
        failed: list[_Ended] = []
        for job in jobs:
            if job.check is not None:
                job.check.result()  # the verification records its result on the job
        self._make_durable(jobs)
        for job in jobs:
            movement = job.movement
            if job.error is not None:
                if isinstance(job.error, TRANSIENT_ERRORS):
                    transient = transient or job.error
                    continue
                log.error("movement %d failed", movement.id, exc_info=job.error)
                self._drop_target(movement, block_key=job.key, target=job.target, bytes_written=job.written)
                failed.append(self._ended(movement, MovementState.FAILED, started=job.started,
                                          error=f"{type(job.error).__name__}: {job.error}"))
            elif job.failure:
                if job.source_bad:
                    self._quarantine(job.source, movement.src_tier, job.key, found_by="move")
                self._drop_target(movement, block_key=job.key, target=job.target, bytes_written=job.written)
                if job.target_bad:
                    checksum_failures_count(tier=movement.dst_tier, found_by="move")
                failed.append(self._ended(movement, MovementState.FAILED, started=job.started, error=job.failure))
            else:
                verified.append(job)
        outcomes.update(self._record(failed))
        if verified:
            self._fault("after-copy", *(job.movement for job in verified))
            with transaction.atomic():
                flipped, refused = self._flip(verified)
                # A warm-up is done once its copy is READY (its source stays): recorded with its
                # flip, one commit. A move is done only once its source is freed, after this commit.
                outcomes.update(self._record([
                    self._ended(job.movement, MovementState.DONE, started=job.started, nbytes=job.block.size_bytes)
                    for job in flipped if not job.free_source]))
            cancelled: list[_Ended] = []
            for job, exc in refused:
                movement = job.movement
                if self._taken_over(job):
                    # A newer attempt of this same movement (a retried or redelivered task running
                    # meanwhile) owns the target now and records the result; this one steps aside.
                    log.warning("movement %d: flip refused (%s); a newer attempt of this movement took its "
                                "target over and finishes it", movement.id, exc)
                    outcomes[movement.id] = Outcome(movement.id, "skipped", f"taken over by a newer attempt: {exc}")
                    continue
                if not job.free_source:
                    # Another attempt took the target over; it owns those bytes now.
                    cancelled.append(self._ended(movement, MovementState.CANCELLED, started=job.started,
                                                 detail=f"the target copy was taken over: {exc}"))
                    continue
                self._drop_target(movement, block_key=job.key, target=job.target)
                log.warning("movement %d: flip refused (%s); the copy changed while it was being moved, "
                            "this attempt's target is dropped and never served", movement.id, exc)
                cancelled.append(self._ended(movement, MovementState.CANCELLED, started=job.started,
                                             detail=f"flip refused, the copy changed during the move: {exc}"))
            outcomes.update(self._record(cancelled))
            moved = [job for job in flipped if job.free_source]
            self._fault("after-flip", *(job.movement for job in moved))
            outcomes.update(self._free_sources(moved))
        if transient is not None:
            raise transient
        return outcomes

    def _make_durable(self, jobs: Sequence[_Copy]) -> None:
        """Before any flip: each target tier makes the copies just written survive a crash of the
        machine (the disk tier syncs the directories it renamed them into), so a copy recorded
        READY is never one a crash can take back. A tier that cannot gives its jobs the error
        (TierUnavailable: transient, the task retries)."""
        written = [job for job in jobs if job.written and job.error is None and not job.failure]
        for tier in sorted({job.movement.dst_tier for job in written}):
            try:
                self.store.tier(tier).sync()
            except Exception as exc:  # noqa: BLE001 - handed to the conclusion, job by job
                for job in written:
                    if job.movement.dst_tier == tier:
                        job.error = exc

    @staticmethod
    def _taken_over(job: _Copy) -> bool:
        """True when a newer attempt reserved this attempt's target again (same row, a later
        epoch, pending or already flipped by it)."""
        current = Placement.objects.filter(id=job.target.id).only("state", "epoch").first()
        return (current is not None and current.epoch > job.target.epoch
                and current.state in (PlacementState.PENDING, PlacementState.READY))

    def _flip(self, jobs: Sequence[_Copy]) -> tuple[list[_Copy], list[tuple[_Copy, Exception]]]:
        """In the caller's transaction: every verified target READY (and, for moves, its source
        DELETING), each flip guarded by its epochs; a refused flip changes nothing and the rest go on."""
        flipped: list[_Copy] = []
        refused: list[tuple[_Copy, Exception]] = []
        flips = [PlacementFlip(target_id=job.target.id, target_epoch=job.target.epoch, checksum=job.checksum_hex,
                               source_id=job.source.id if job.free_source else None,
                               source_epoch=job.movement.src_epoch if job.free_source else None)
                 for job in jobs]
        for job, error in zip(jobs, placements_flip_many(flips=flips), strict=True):
            if error is None:
                flipped.append(job)
            elif isinstance(error, _FENCED):
                refused.append((job, error))
            else:
                raise error  # not a race: no flip of the wave is committed, as before
        return flipped, refused

    def _free_sources(self, moved: Sequence[_Copy]) -> dict[int, Outcome]:
        """After the moves' flips are committed: free each source (bytes first, then its row, as
        `_free` does), then forget the freed rows and record every result, in one transaction of
        two statements (`placements_delete_many`, `movements_finish_many`)."""
        if not moved:
            return {}
        rows = Placement.objects.in_bulk([job.source.id for job in moved])
        freed: list[tuple[int, int]] = []
        for job in moved:
            current = rows.get(job.source.id)
            if current is None or current.state != PlacementState.DELETING or current.epoch != job.movement.src_epoch + 1:
                continue  # re-registered or already freed: the bytes are someone else's now
            self.store.tier(job.movement.src_tier).delete(job.key)
            freed.append((current.id, current.epoch))
        with transaction.atomic():
            placements_delete_many(placements=freed)  # a copy that changed meanwhile is left alone
            return self._record([self._ended(job.movement, MovementState.DONE, started=job.started,
                                             nbytes=job.block.size_bytes) for job in moved])

    def _reserve(self, wanted: Sequence[_Reservation]) -> tuple[list[_Copy], list[_Ended]]:
        """PENDING target copies for a wave's movements, each with a fresh epoch, in one statement;
        a pending target left by an earlier attempt of the same movement is taken over first, so
        that attempt can no longer flip or drop it. Returns the copies to make and the results of
        the movements whose target could not be reserved (the destination holds a copy already)."""
        if not wanted:
            return [], []
        for reservation in wanted:
            previous = reservation.previous
            if previous is not None and previous.state == PlacementState.PENDING:
                try:
                    placement_mark_deleting(placement_id=previous.id, epoch=previous.epoch)
                except _FENCED:
                    pass
        copies = [PendingCopy(block_id=r.block.id, tier=r.movement.dst_tier, node=r.movement.dst_node or None,
                              size_bytes=r.block.size_bytes) for r in wanted]
        try:
            with transaction.atomic():
                answers: list[Placement | Exception] = list(placements_create_pending_many(copies=copies))
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - no single copy's answer: ask for each alone, so it stays its own
            log.warning("reserving %d target copies at once failed (%s); reserving them one by one", len(copies), exc)
            answers = [self._reserve_one(copy) for copy in copies]
        jobs: list[_Copy] = []
        refused: list[_Ended] = []
        for r, answer in zip(wanted, answers, strict=True):
            if isinstance(answer, Placement):
                r.movement.dst_placement_id = answer.id
                jobs.append(_Copy(movement=r.movement, block=r.block, key=r.block.prefix_key, source=r.source,
                                  target=answer, free_source=r.free_source, started=r.started))
            elif isinstance(answer, InvalidTransition):
                refused.append(self._ended(r.movement, MovementState.CANCELLED, started=r.started,
                                           detail=f"the destination already holds a copy of the block: {answer}"))
            else:
                log.error("movement %d: its target copy could not be reserved", r.movement.id, exc_info=answer)
                refused.append(self._ended(r.movement, MovementState.FAILED, started=r.started,
                                           error=f"{type(answer).__name__}: {answer}"))
        movements_set_targets(targets=[(job.movement.id, job.target.id) for job in jobs])
        return jobs, refused

    @staticmethod
    def _reserve_one(copy: PendingCopy) -> Placement | Exception:
        try:
            with transaction.atomic():
                [answer] = placements_create_pending_many(copies=[copy])
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - this copy's own answer
            return exc
        return answer

    def _verify_target(self, tier: str, key: uuid.UUID, expected: str) -> str:
        """'' when the target copy carries the expected checksum (and, verifying fully, every byte
        of it passes); otherwise what is wrong."""
        try:
            if self.options.verify == "full":
                read = self.store.tier(tier).get(key, self._buffer("verify"))
                got = read.checksum.hex if read.checksum is not None else ""
            else:
                stored = self.store.tier(tier).checksum(key)
                if stored is None:
                    read = self.store.tier(tier).get(key, self._buffer("verify"))
                    stored = read.checksum
                got = stored.hex if stored is not None else ""
        except (BlockCorrupt, BlockMissing) as exc:
            return f"the target copy failed verification: {exc}"
        if got != expected:
            return f"the target copy's checksum {got} is not the source's {expected}"
        return ""

    def _drop_target(self, movement: Movement, *, block_key: uuid.UUID | None, target: Placement | None = None,
                     bytes_written: bool = True) -> None:
        """Remove this attempt's own target copy: only while it is still PENDING at the epoch this
        attempt reserved it with (after a takeover or a flip it belongs to someone else)."""
        if target is None:
            if not movement.dst_placement_id:
                return
            target = Placement.objects.filter(id=movement.dst_placement_id).first()
            if target is None or target.state != PlacementState.PENDING:
                return
        try:
            marked = placement_mark_deleting(placement_id=target.id, epoch=target.epoch)
        except _FENCED:
            return
        if bytes_written and block_key is not None and self.store is not None:
            self.store.tier(movement.dst_tier).delete(block_key)
        try:
            placement_delete(placement_id=marked.id, epoch=marked.epoch)
        except _FENCED:
            pass

    def _free(self, source: Placement | None, movement: Movement, key: uuid.UUID) -> None:
        """Free the source after a flip: bytes first, then the row (a row without bytes would be
        a READY-looking lie only if it were READY; it is DELETING by now)."""
        if source is None:
            return
        current = Placement.objects.filter(id=source.id).first()
        if current is None or current.state != PlacementState.DELETING or current.epoch != source.epoch:
            return  # re-registered or already freed: the bytes are someone else's now
        self.store.tier(movement.src_tier).delete(key)
        try:
            placement_delete(placement_id=current.id, epoch=current.epoch)
        except _FENCED:
            pass

    def _quarantine(self, placement: Placement, tier: str, key: uuid.UUID, *, found_by: str) -> None:
        """A copy that failed verification is never served again: mark it corrupt, drop its bytes
        (the tier already dropped them if its own read found the damage), count it."""
        try:
            placement_mark_corrupt(placement_id=placement.id)
        except _FENCED:
            pass
        try:
            self.store.tier(tier).delete(key)
        except TierUnavailable:
            pass
        checksum_failures_count(tier=tier, found_by=found_by)
        log.warning("%s copy of block %s (placement %d) failed verification: quarantined", tier, key, placement.id)

    # -- evictions ----------------------------------------------------------------------------
    def _evict(self, movement: Movement) -> Outcome:
        started = time.perf_counter()
        source = Placement.objects.filter(id=movement.src_placement_id).first()
        if source is None:
            state = MovementState.DONE if movement.attempts > 1 else MovementState.CANCELLED
            return self._finish(movement, state, started=started, detail="the copy no longer exists")
        block = self._block(movement)
        if movement.src_tier not in self.store.names:
            return self._finish(movement, MovementState.FAILED, started=started,
                                error=f"tier: node {self.node} has no {movement.src_tier} tier")
        resumed = source.state == PlacementState.DELETING and source.epoch == movement.src_epoch + 1
        if not resumed:
            if source.state != PlacementState.READY or source.epoch != movement.src_epoch:
                return self._finish(movement, MovementState.CANCELLED, started=started,
                                    detail=f"the copy changed since planning (now {source.state} at epoch "
                                           f"{source.epoch}, planned at epoch {movement.src_epoch})")
            try:
                source = placement_mark_deleting(placement_id=source.id, epoch=movement.src_epoch)
            except _FENCED as exc:
                return self._finish(movement, MovementState.CANCELLED, started=started, detail=str(exc))
        if block is not None:
            self.store.tier(movement.src_tier).delete(block.prefix_key)
        try:
            placement_delete(placement_id=source.id, epoch=source.epoch)
        except _FENCED:
            pass
        return self._finish(movement, MovementState.DONE, started=started, nbytes=source.size_bytes)

    # -- scrub --------------------------------------------------------------------------------
    def _placements(self, tier: str, *, states: Sequence[str] = (PlacementState.READY,)) -> Iterable[list[Placement]]:
        """This node's copies in `tier` (the shared ones for remote), in id-ordered batches."""
        node_id = None if tier == Tier.REMOTE else Node.objects.filter(name=self.node).values_list("id", flat=True).first()
        if tier != Tier.REMOTE and node_id is None:
            return
        last = 0
        while True:
            rows = Placement.objects.filter(tier=tier, state__in=states, id__gt=last)
            rows = rows.filter(node__isnull=True) if node_id is None else rows.filter(node_id=node_id)
            batch = list(rows.select_related("block").order_by("id")[: self.options.scrub_batch])
            if not batch:
                return
            last = batch[-1].id
            yield batch

    def scrub(self, tier: str) -> ScrubReport:
        """Read every READY copy this node holds in `tier` and verify its checksum and size; a
        copy that fails is quarantined (marked corrupt, bytes dropped) and counted."""
        if self.store is None:
            raise NoStore(f"node {self.node} serves no model: nothing to scrub")
        report = ScrubReport(tier=tier)
        if tier not in self.store.names:
            return report
        buffer = self._buffer("scrub")
        for batch in self._placements(tier):
            for placement in batch:
                if placement.block.size_bytes != self.store.layout.block_bytes:
                    continue  # another model's block: not this store's to judge
                report.checked += 1
                key = placement.block.prefix_key
                problem = ""
                try:
                    read = self.store.tier(tier).get(key, buffer)
                    got = read.checksum.hex if read.checksum is not None else ""
                    if placement.checksum and got != placement.checksum:
                        problem = f"checksum {got} is not the recorded {placement.checksum}"
                    elif placement.size_bytes != read.nbytes:
                        problem = f"{read.nbytes} bytes, {placement.size_bytes} recorded"
                except BlockCorrupt as exc:
                    problem = exc.reason
                except BlockMissing:
                    problem = "bytes missing"
                    report.missing += 1
                if problem:
                    report.corrupt += 1
                    log.warning("scrub %s: block %s (placement %d): %s", tier, key, placement.id, problem)
                    self._quarantine(placement, tier, key, found_by="scrub")
        log.info("scrub of %s on node %s: %d copies checked, %d quarantined (%d missing)", tier, self.node,
                 report.checked, report.corrupt, report.missing)
        return report

    # -- reconcile ----------------------------------------------------------------------------
    def _keys(self, tier: str) -> set[uuid.UUID]:
        return set(self.store.tier(tier).keys())

    def reconcile(self, tier: str, *, now: float | None = None) -> ReconcileReport:
        """Bytes without a placement row are deleted (after the grace period: seen orphaned by a
        reconcile at least that long ago); READY rows whose bytes are gone are marked corrupt."""
        if self.store is None:
            raise NoStore(f"node {self.node} serves no model: nothing to reconcile")
        report = ReconcileReport(tier=tier)
        if tier not in self.store.names:
            return report
        now = time.monotonic() if now is None else now
        # Rows first, then bytes: a copy written after the listing cannot look missing.
        ready = [(p.id, p.epoch, p.block.prefix_key) for batch in self._placements(tier) for p in batch]
        present = self._keys(tier)
        for ident, epoch, key in ready:
            if key in present or self.store.tier(tier).contains(key):
                continue
            try:
                placement_mark_corrupt(placement_id=ident, epoch=epoch)
            except _FENCED:
                continue
            report.missing_marked += 1
            checksum_failures_count(tier=tier, found_by="reconcile")
            log.warning("reconcile %s: placement %d (block %s) has no bytes: marked corrupt", tier, ident, key)
        known = self._known_keys(tier, present)
        with self._orphans_lock:
            for key in present - known:
                report.orphans_seen += 1
                first = self._orphans.setdefault((tier, key), now)
                if now - first >= self.options.reconcile_grace_s and key not in self._known_keys(tier, {key}):
                    self.store.tier(tier).delete(key)
                    self._orphans.pop((tier, key), None)
                    report.orphans_deleted += 1
            for tier_key in [k for k in self._orphans if k[0] == tier and k[1] in known]:
                self._orphans.pop(tier_key, None)
        if report.orphans_deleted or report.missing_marked:
            log.warning("reconcile of %s on node %s: %d orphan block(s) deleted, %d copies without bytes "
                        "marked corrupt", tier, self.node, report.orphans_deleted, report.missing_marked)
        return report

    def _known_keys(self, tier: str, keys: set[uuid.UUID]) -> set[uuid.UUID]:
        """Which of `keys` have a placement row of any state in this node's `tier`."""
        if not keys:
            return set()
        ordered = sorted(keys)
        found: set[uuid.UUID] = set()
        for start in range(0, len(ordered), 1000):  # the prefix-key index serves each IN list
            rows = Placement.objects.filter(tier=tier, block__prefix_key__in=ordered[start:start + 1000])
            rows = rows.filter(node__isnull=True) if tier == Tier.REMOTE else rows.filter(node__name=self.node)
            found.update(rows.values_list("block__prefix_key", flat=True))
        return found


def executor_for(app: Any) -> MovementExecutor:
    """The executor of the node this worker process runs (created on first use, kept on the
    node runtime)."""
    runtime = app.strata_runtime
    executor = getattr(runtime, "movements", None)
    if executor is None:
        close_old_connections()
        executor = MovementExecutor(node=runtime.config.node_name, store=runtime.store)
        runtime.movements = executor
    return executor
