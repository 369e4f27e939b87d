"""The node's movement executor: moves, evictions and warm-ups under the directory's epoch fencing.

Every step is safe to run twice. A move reserves a PENDING target copy, has the mover
(`worker.dataplane.mover`) copy and verify the bytes, then flips target READY and source DELETING
in one transaction guarded by both epochs; only then are the source bytes freed and the result
recorded. A worker that dies anywhere leaves either the old copy READY (before the flip) or the
new one (after it); its task is delivered again and resumes from what the directory says. A flip
refused by an epoch means someone else changed the block: the worker drops its own target (only
while the target is still its own) and never serves it.

This module is the fencing only: the bytes move in the data plane's mover, scrub and reconcile
live in `scrub.py` and `reconcile.py`, fault injection in `faults.py`, the dashboard's counts in
`announcer.py`. The directory and the movement ledger are read and written through
`controlplane.node_api`, whose answers are plain records (`MovementRecord`, `CopyRecord`,
`BlockRecord`).

Why one module: reserve, move, flip, free and record are one protocol over one batch's state
(its reservations, epochs and outcomes); each step's guard is only readable beside the steps it
orders, so they stay together.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.db import close_old_connections, transaction

from controlplane.node_api import (
    BlockRecord,
    CopyRecord,
    InvalidTransition,
    MovementKind,
    MovementRecord,
    MovementResult,
    MovementState,
    PendingCopy,
    PlacementFlip,
    PlacementState,
    block_get,
    blocks_by_id,
    checksum_failures_count,
    copies_by_id,
    copy_get,
    movement_start,
    movements_finish_many,
    movements_set_targets,
    movements_start_many,
    placement_delete,
    placement_mark_deleting,
    placements_create_pending_many,
    placements_delete_many,
    placements_flip_many,
)
from worker.dataplane.mover import CopyStatus, Mover
from worker.movement_executor.announcer import MovementAnnouncer
from worker.movement_executor.copies import quarantine
from worker.movement_executor.errors import FENCED, TRANSIENT_ERRORS, NoStore
from worker.movement_executor.faults import FaultInjector
from worker.movement_executor.options import MovementOptions
from worker.movement_executor.reconcile import Reconciler, ReconcileReport
from worker.movement_executor.records import Outcome, Reservation, ReservedCopy
from worker.movement_executor.scrub import ScrubReport, scrub_tier

log = logging.getLogger("strata.movements")

WAVE_BYTES = 128 << 20
"""Blocks of a batch are reserved, copied and flipped in waves of about this many bytes (at least
one block): big enough that a wave's I/O covers the next wave's database work with room to spare
on a busy node (a wave costs three commits and about a dozen statements whatever its size). The
mover's pipeline runs on across waves when the next wave is submitted before this one's last reads
(`worker.dataplane.mover.NextWave`). `_waves` keeps the first and the last wave to one block."""


def _waves(ids: Sequence[int], per_wave: int) -> list[Sequence[int]]:
    """`ids` in waves of `per_wave`, except that the first and the last wave hold one block each
    (when there are more than two waves' worth): nothing overlaps the first wave's reservation
    or the last wave's flip and conclusion, so the smaller they are, the less the batch waits
    on them (with the bulk services a wave's database work is a few statements whatever its
    size)."""
    if per_wave <= 1 or len(ids) <= 2 * per_wave:
        return [ids[start : start + per_wave] for start in range(0, len(ids), per_wave)]
    middle = ids[1:-1]
    return [ids[:1], *(middle[start : start + per_wave] for start in range(0, len(middle), per_wave)), ids[-1:]]


_Ended = tuple[MovementRecord, MovementResult]
"""A movement and the result to record for it (`MovementExecutor._record` records a wave's at once)."""


class MovementExecutor:
    """Executes one node's movements, scrubs and reconciles against its store."""

    def __init__(self, *, node: str, store: Any, options: MovementOptions | None = None) -> None:
        self.node = node
        self.store = store
        self.options = options or MovementOptions.from_environ()
        self.announcer = MovementAnnouncer(node)
        self.faults = FaultInjector(node=node, point=self.options.fault_point, hold_s=self.options.fault_hold_s)
        self.mover = Mover(store, verify=self.options.verify) if store is not None else None
        self.reconciler = Reconciler(
            node=node, store=store, grace_s=self.options.reconcile_grace_s, batch=self.options.scrub_batch
        )

    @staticmethod
    def _ended(
        movement: MovementRecord,
        state: str,
        *,
        started: float,
        detail: str = "",
        error: str = "",
        nbytes: int | None = None,
    ) -> _Ended:
        """The result of a movement that ended now (its duration counted from `started`)."""
        return movement, MovementResult(
            movement_id=movement.id,
            state=state,
            nbytes=nbytes,
            duration_s=time.perf_counter() - started,
            detail=detail,
            error=error,
        )

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
            line = (
                f"movement {movement.id} ({movement.kind} block {movement.block_id} {movement.route}): {result.state}"
            )
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

    def _finish(
        self,
        movement: MovementRecord,
        state: str,
        *,
        started: float,
        detail: str = "",
        error: str = "",
        nbytes: int | None = None,
    ) -> Outcome:
        ended = self._ended(movement, state, started=started, detail=detail, error=error, nbytes=nbytes)
        return self._record([ended])[movement.id]

    def run(self, kind: str, movement_ids: Sequence[int]) -> list[Outcome]:
        """Execute a batch of movements of one kind, in order. Transient errors (database or
        Redis away) propagate, so the task retries the batch; finished ones are then skipped."""
        if kind in (MovementKind.MOVE, MovementKind.WARM):
            return self._run_copies(kind, movement_ids)
        step: Callable[[MovementRecord], Outcome] = {MovementKind.EVICT: self._evict}[kind]  # type: ignore[index]
        outcomes = []
        for ident in movement_ids:
            movement = movement_start(movement_id=ident, node=self.node)
            if movement is None:
                outcomes.append(Outcome(ident, "skipped", "already finished"))
                continue
            if movement.kind != kind:
                outcomes.append(
                    self._finish(
                        movement,
                        MovementState.FAILED,
                        started=time.perf_counter(),
                        error=f"kind: sent as {kind} but planned as {movement.kind}",
                    )
                )
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
                outcomes.append(
                    self._finish(movement, MovementState.FAILED, started=started, error=f"{type(exc).__name__}: {exc}")
                )
        return outcomes

    # -- checks -----------------------------------------------------------------------------
    def _block(self, movement: MovementRecord) -> BlockRecord | None:
        return block_get(movement.block_id)

    def _layout_problem(self, block: BlockRecord, *tiers: str) -> str:
        for tier in tiers:
            if tier not in self.store.names:
                return f"tier: node {self.node} has no {tier} tier (it has {', '.join(self.store.names)})"
        if block.size_bytes != self.store.layout.block_bytes:
            return (
                f"block {block.id} is {block.size_bytes} bytes but this node's model stores "
                f"{self.store.layout.block_bytes}-byte blocks: it belongs to another model"
            )
        return ""

    # -- moves and warm-ups: reserve -> move -> flip -> free -> record -----------------------
    def _run_copies(self, kind: str, movement_ids: Sequence[int]) -> list[Outcome]:
        """Moves and warm-ups of a batch, in waves of about WAVE_BYTES (`_waves`). Each wave costs three
        database commits instead of six per movement (each commit waits for PostgreSQL's WAL to
        reach its disk) and about a dozen statements whatever its size (the bulk services): one
        commit starts its movements and reserves their targets, one flips the verified copies, one
        frees the sources and records the results. While one wave's bytes flow through the mover's
        pipeline, this thread reserves the next wave and concludes the previous one, so the database
        work hides behind the I/O. Each commit still comes before the step it guards: a target is
        reserved before its bytes are written, a flip is durable before its source is freed."""
        ids = list(dict.fromkeys(movement_ids))
        if self.mover is None:
            per_wave = len(ids)
        else:
            per_wave = max(1, WAVE_BYTES // self.store.layout.block_bytes)
        outcomes: dict[int, Outcome] = {}
        copying: list[ReservedCopy] = []
        with self.mover.batch() if self.mover is not None else contextlib.nullcontext() as batch:
            for wave in _waves(ids, per_wave):
                reserved = self._start_wave(kind, wave, outcomes)
                copied, copying = copying, reserved
                if reserved:
                    self.faults.hold("after-reserve", *(copy.movement for copy in reserved))
                    assert batch is not None  # a wave reserves copies only on a node with a store
                    futures = batch.submit([copy.job for copy in reserved])
                    for copy, future in zip(reserved, futures, strict=True):
                        copy.copying = future
                if copied:
                    outcomes.update(self._conclude(copied))
            if copying:
                outcomes.update(self._conclude(copying))
        return [outcomes[ident] for ident in movement_ids]

    def _start_wave(self, kind: str, ids: Sequence[int], outcomes: dict[int, Outcome]) -> list[ReservedCopy]:
        """One transaction of a few statements, whatever the wave's size: start its movements
        (`movements_start_many`), read their blocks and copies, check each against the directory,
        reserve the targets of the ones to copy (`placements_create_pending_many`) and record the
        results of the others (`movements_finish_many`). Each movement is still judged on its own:
        a stale source cancels only its movement. Returns the copies to make; the other
        movements' outcomes go into `outcomes`."""
        with transaction.atomic():
            started = time.perf_counter()
            ended: list[_Ended] = []
            checked: list[MovementRecord] = []
            for ident, movement in zip(ids, movements_start_many(movement_ids=ids, node=self.node), strict=True):
                if movement is None:
                    outcomes[ident] = Outcome(ident, "skipped", "already finished")
                elif movement.kind != kind:
                    ended.append(
                        self._ended(
                            movement,
                            MovementState.FAILED,
                            started=started,
                            error=f"kind: sent as {kind} but planned as {movement.kind}",
                        )
                    )
                elif self.store is None:
                    ended.append(
                        self._ended(
                            movement,
                            MovementState.FAILED,
                            started=started,
                            error=f"node {self.node} serves no model: it has no tiered store to move bytes with",
                        )
                    )
                else:
                    checked.append(movement)
            blocks = blocks_by_id([m.block_id for m in checked])
            copies = copies_by_id(
                [m.src_placement_id for m in checked] + [m.dst_placement_id for m in checked if m.dst_placement_id]
            )
            wanted: list[Reservation] = []
            for movement in checked:
                try:
                    prepared = self._prepare(
                        movement,
                        block=blocks.get(movement.block_id),
                        source=copies.get(movement.src_placement_id),
                        target=copies.get(movement.dst_placement_id or 0),
                        free_source=kind == MovementKind.MOVE,
                        started=started,
                    )
                except TRANSIENT_ERRORS:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded in the ledger, then the wave goes on
                    log.exception("movement %d failed", movement.id)
                    ended.append(
                        self._ended(
                            movement, MovementState.FAILED, started=started, error=f"{type(exc).__name__}: {exc}"
                        )
                    )
                    continue
                if isinstance(prepared, Reservation):
                    wanted.append(prepared)
                else:
                    ended.append(prepared)
            jobs, refused = self._reserve(wanted)
            outcomes.update(self._record([*ended, *refused]))
        return jobs

    def _prepare(
        self,
        movement: MovementRecord,
        *,
        block: BlockRecord | None,
        source: CopyRecord | None,
        target: CopyRecord | None,
        free_source: bool,
        started: float,
    ) -> Reservation | _Ended:
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
        if (
            free_source
            and target is not None
            and target.state == PlacementState.READY
            and (source is None or (source.state == PlacementState.DELETING and source.epoch == movement.src_epoch + 1))
        ):
            # A previous attempt flipped and died before freeing the source: finish its work.
            with transaction.atomic():
                self._free(source, movement, key)
            return self._ended(
                movement, MovementState.DONE, started=started, nbytes=target.size_bytes, detail="resumed after the flip"
            )
        if not free_source and target is not None and target.state == PlacementState.READY:
            return self._ended(
                movement,
                MovementState.DONE,
                started=started,
                nbytes=target.size_bytes,
                detail="resumed: the warm copy was ready",
            )
        if source is None or source.state != PlacementState.READY or source.epoch != movement.src_epoch:
            with transaction.atomic():
                self._drop_target(movement, block_key=key)
            now = "gone" if source is None else f"{source.state} at epoch {source.epoch}"
            return self._ended(
                movement,
                MovementState.CANCELLED,
                started=started,
                detail=f"the source copy changed since planning (now {now}, planned at epoch {movement.src_epoch})",
            )
        return Reservation(
            movement=movement, block=block, source=source, previous=target, free_source=free_source, started=started
        )

    def _conclude(self, jobs: Sequence[ReservedCopy]) -> dict[int, Outcome]:
        """Turn the copies into directory changes: failed ones are cleaned up one by one and their
        results recorded together; the verified ones are flipped in one transaction (a warm-up's
        result recorded in it), the moves' sources freed and their results recorded in another. A
        transient error is raised after the rest is concluded."""
        outcomes: dict[int, Outcome] = {}
        transient: BaseException | None = None
        verified: list[ReservedCopy] = []
        failed: list[_Ended] = []
        assert self.mover is not None  # only a node with a store reserves copies
        results = [job.copying.result() for job in jobs if job.copying is not None]
        durable = self.mover.make_durable([job.job for job in jobs], results)
        for job, result in zip(jobs, durable, strict=True):
            job.result = result
            movement = job.movement
            if result.error is not None:
                if isinstance(result.error, TRANSIENT_ERRORS):
                    transient = transient or result.error
                    continue
                log.error("movement %d failed", movement.id, exc_info=result.error)
                self._drop_target(movement, block_key=job.key, target=job.target, bytes_written=result.written)
                failed.append(
                    self._ended(
                        movement,
                        MovementState.FAILED,
                        started=job.started,
                        error=f"{type(result.error).__name__}: {result.error}",
                    )
                )
            elif not result.done:
                if result.status == CopyStatus.SOURCE_CORRUPT:
                    quarantine(self.store, job.source.id, movement.src_tier, job.key, found_by="move")
                self._drop_target(movement, block_key=job.key, target=job.target, bytes_written=result.written)
                if result.status == CopyStatus.TARGET_CORRUPT:
                    checksum_failures_count(tier=movement.dst_tier, found_by="move")
                failed.append(self._ended(movement, MovementState.FAILED, started=job.started, error=result.reason))
            else:
                verified.append(job)
        outcomes.update(self._record(failed))
        if verified:
            self.faults.hold("after-copy", *(job.movement for job in verified))
            with transaction.atomic():
                flipped, refused = self._flip(verified)
                # A warm-up is done once its copy is READY (its source stays): recorded with its
                # flip, one commit. A move is done only once its source is freed, after this commit.
                outcomes.update(
                    self._record(
                        [
                            self._ended(
                                job.movement, MovementState.DONE, started=job.started, nbytes=job.block.size_bytes
                            )
                            for job in flipped
                            if not job.free_source
                        ]
                    )
                )
            cancelled: list[_Ended] = []
            for job, exc in refused:
                movement = job.movement
                if self._taken_over(job):
                    # A newer attempt of this same movement (a retried or redelivered task running
                    # meanwhile) owns the target now and records the result; this one steps aside.
                    log.warning(
                        "movement %d: flip refused (%s); a newer attempt of this movement took its "
                        "target over and finishes it",
                        movement.id,
                        exc,
                    )
                    outcomes[movement.id] = Outcome(movement.id, "skipped", f"taken over by a newer attempt: {exc}")
                    continue
                if not job.free_source:
                    # Another attempt took the target over; it owns those bytes now.
                    cancelled.append(
                        self._ended(
                            movement,
                            MovementState.CANCELLED,
                            started=job.started,
                            detail=f"the target copy was taken over: {exc}",
                        )
                    )
                    continue
                self._drop_target(movement, block_key=job.key, target=job.target)
                log.warning(
                    "movement %d: flip refused (%s); the copy changed while it was being moved, "
                    "this attempt's target is dropped and never served",
                    movement.id,
                    exc,
                )
                cancelled.append(
                    self._ended(
                        movement,
                        MovementState.CANCELLED,
                        started=job.started,
                        detail=f"flip refused, the copy changed during the move: {exc}",
                    )
                )
            outcomes.update(self._record(cancelled))
            moved = [job for job in flipped if job.free_source]
            self.faults.hold("after-flip", *(job.movement for job in moved))
            outcomes.update(self._free_sources(moved))
        if transient is not None:
            raise transient
        return outcomes

    @staticmethod
    def _taken_over(job: ReservedCopy) -> bool:
        """True when a newer attempt reserved this attempt's target again (same row, a later
        epoch, pending or already flipped by it)."""
        current = copy_get(job.target.id)
        return (
            current is not None
            and current.epoch > job.target.epoch
            and current.state in (PlacementState.PENDING, PlacementState.READY)
        )

    def _flip(self, jobs: Sequence[ReservedCopy]) -> tuple[list[ReservedCopy], list[tuple[ReservedCopy, Exception]]]:
        """In the caller's transaction: every verified target READY (and, for moves, its source
        DELETING), each flip guarded by its epochs; a refused flip changes nothing and the rest go on."""
        flipped: list[ReservedCopy] = []
        refused: list[tuple[ReservedCopy, Exception]] = []
        flips = [
            PlacementFlip(
                target_id=job.target.id,
                target_epoch=job.target.epoch,
                checksum=job.result.checksum if job.result is not None else "",
                source_id=job.source.id if job.free_source else None,
                source_epoch=job.movement.src_epoch if job.free_source else None,
            )
            for job in jobs
        ]
        for job, error in zip(jobs, placements_flip_many(flips=flips), strict=True):
            if error is None:
                flipped.append(job)
            elif isinstance(error, FENCED):
                refused.append((job, error))
            else:
                raise error  # not a race: no flip of the wave is committed, as before
        return flipped, refused

    def _free_sources(self, moved: Sequence[ReservedCopy]) -> dict[int, Outcome]:
        """After the moves' flips are committed: free each source (bytes first, then its row, as
        `_free` does), then forget the freed rows and record every result, in one transaction of
        two statements (`placements_delete_many`, `movements_finish_many`)."""
        if not moved:
            return {}
        rows = copies_by_id([job.source.id for job in moved])
        freed: list[tuple[int, int]] = []
        for job in moved:
            current = rows.get(job.source.id)
            if (
                current is None
                or current.state != PlacementState.DELETING
                or current.epoch != job.movement.src_epoch + 1
            ):
                continue  # re-registered or already freed: the bytes are someone else's now
            self.store.tier(job.movement.src_tier).delete(job.key)
            freed.append((current.id, current.epoch))
        with transaction.atomic():
            placements_delete_many(placements=freed)  # a copy that changed meanwhile is left alone
            return self._record(
                [
                    self._ended(job.movement, MovementState.DONE, started=job.started, nbytes=job.block.size_bytes)
                    for job in moved
                ]
            )

    def _reserve(self, wanted: Sequence[Reservation]) -> tuple[list[ReservedCopy], list[_Ended]]:
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
                except FENCED:
                    pass
        copies = [
            PendingCopy(
                block_id=r.block.id,
                tier=r.movement.dst_tier,
                node=r.movement.dst_node or None,
                size_bytes=r.block.size_bytes,
            )
            for r in wanted
        ]
        try:
            with transaction.atomic():
                answers: list[CopyRecord | Exception] = list(placements_create_pending_many(copies=copies))
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - no single copy's answer: ask for each alone, so it stays its own
            log.warning("reserving %d target copies at once failed (%s); reserving them one by one", len(copies), exc)
            answers = [self._reserve_one(copy) for copy in copies]
        jobs: list[ReservedCopy] = []
        refused: list[_Ended] = []
        for r, answer in zip(wanted, answers, strict=True):
            if isinstance(answer, CopyRecord):
                r.movement.dst_placement_id = answer.id
                jobs.append(
                    ReservedCopy(
                        movement=r.movement,
                        block=r.block,
                        key=r.block.prefix_key,
                        source=r.source,
                        target=answer,
                        free_source=r.free_source,
                        started=r.started,
                    )
                )
            elif isinstance(answer, InvalidTransition):
                refused.append(
                    self._ended(
                        r.movement,
                        MovementState.CANCELLED,
                        started=r.started,
                        detail=f"the destination already holds a copy of the block: {answer}",
                    )
                )
            else:
                log.error("movement %d: its target copy could not be reserved", r.movement.id, exc_info=answer)
                refused.append(
                    self._ended(
                        r.movement, MovementState.FAILED, started=r.started, error=f"{type(answer).__name__}: {answer}"
                    )
                )
        movements_set_targets(targets=[(job.movement.id, job.target.id) for job in jobs])
        return jobs, refused

    @staticmethod
    def _reserve_one(copy: PendingCopy) -> CopyRecord | Exception:
        try:
            with transaction.atomic():
                [answer] = placements_create_pending_many(copies=[copy])
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - this copy's own answer
            return exc
        return answer

    def _drop_target(
        self,
        movement: MovementRecord,
        *,
        block_key: uuid.UUID | None,
        target: CopyRecord | None = None,
        bytes_written: bool = True,
    ) -> None:
        """Remove this attempt's own target copy: only while it is still PENDING at the epoch this
        attempt reserved it with (after a takeover or a flip it belongs to someone else)."""
        if target is None:
            if not movement.dst_placement_id:
                return
            target = copy_get(movement.dst_placement_id)
            if target is None or target.state != PlacementState.PENDING:
                return
        try:
            marked = placement_mark_deleting(placement_id=target.id, epoch=target.epoch)
        except FENCED:
            return
        if bytes_written and block_key is not None and self.store is not None:
            self.store.tier(movement.dst_tier).delete(block_key)
        try:
            placement_delete(placement_id=marked.id, epoch=marked.epoch)
        except FENCED:
            pass

    def _free(self, source: CopyRecord | None, movement: MovementRecord, key: uuid.UUID) -> None:
        """Free the source after a flip: bytes first, then the row (a row without bytes would be
        a READY-looking lie only if it were READY; it is DELETING by now)."""
        if source is None:
            return
        current = copy_get(source.id)
        if current is None or current.state != PlacementState.DELETING or current.epoch != source.epoch:
            return  # re-registered or already freed: the bytes are someone else's now
        self.store.tier(movement.src_tier).delete(key)
        try:
            placement_delete(placement_id=current.id, epoch=current.epoch)
        except FENCED:
            pass

    # -- evictions ----------------------------------------------------------------------------
    def _evict(self, movement: MovementRecord) -> Outcome:
        started = time.perf_counter()
        source = copy_get(movement.src_placement_id)
        if source is None:
            state = MovementState.DONE if movement.attempts > 1 else MovementState.CANCELLED
            return self._finish(movement, state, started=started, detail="the copy no longer exists")
        block = self._block(movement)
        if movement.src_tier not in self.store.names:
            return self._finish(
                movement,
                MovementState.FAILED,
                started=started,
                error=f"tier: node {self.node} has no {movement.src_tier} tier",
            )
        resumed = source.state == PlacementState.DELETING and source.epoch == movement.src_epoch + 1
        if not resumed:
            if source.state != PlacementState.READY or source.epoch != movement.src_epoch:
                return self._finish(
                    movement,
                    MovementState.CANCELLED,
                    started=started,
                    detail=f"the copy changed since planning (now {source.state} at epoch "
                    f"{source.epoch}, planned at epoch {movement.src_epoch})",
                )
            try:
                source = placement_mark_deleting(placement_id=source.id, epoch=movement.src_epoch)
            except FENCED as exc:
                return self._finish(movement, MovementState.CANCELLED, started=started, detail=str(exc))
        if block is not None:
            self.store.tier(movement.src_tier).delete(block.prefix_key)
        try:
            placement_delete(placement_id=source.id, epoch=source.epoch)
        except FENCED:
            pass
        return self._finish(movement, MovementState.DONE, started=started, nbytes=source.size_bytes)

    # -- scrub and reconcile -----------------------------------------------------------------
    def scrub(self, tier: str) -> ScrubReport:
        """Read every READY copy this node holds in `tier` and verify its checksum and size; a
        copy that fails is quarantined (marked corrupt, bytes dropped) and counted."""
        if self.store is None or self.mover is None:
            raise NoStore(f"node {self.node} serves no model: nothing to scrub")
        return scrub_tier(
            node=self.node,
            store=self.store,
            tier=tier,
            buffer=self.mover.buffer("scrub"),
            batch=self.options.scrub_batch,
        )

    def reconcile(self, tier: str, *, now: float | None = None) -> ReconcileReport:
        """Bytes without a placement row are deleted (after the grace period: seen orphaned by a
        reconcile at least that long ago); READY rows whose bytes are gone are marked corrupt."""
        if self.store is None:
            raise NoStore(f"node {self.node} serves no model: nothing to reconcile")
        return self.reconciler.reconcile(tier, now=now)


def executor_for(app: Any) -> MovementExecutor:
    """The executor of the node this worker process runs (created on first use, kept on the
    node runtime), with the movement options of the node's configuration."""
    runtime = app.strata_runtime
    executor = getattr(runtime, "movements", None)
    if executor is None:
        close_old_connections()
        executor = MovementExecutor(
            node=runtime.config.node_name, store=runtime.store, options=MovementOptions.from_config(runtime.config)
        )
        runtime.movements = executor
    return executor
