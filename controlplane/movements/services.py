"""Movements writes: plan (the planner computes, this module holds the transaction and the tier
locks), record and dispatch planned movements, move them through their states, keep the metrics'
tallies and the reconcile job's tier recounts, and the operator's "run migration now"."""

from __future__ import annotations

import dataclasses
import logging
import uuid
import zlib
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.celery_app import app
from controlplane.directory.choices import NodeState, TierLevel
from controlplane.directory.models import Namespace, Node, NodeTier
from controlplane.directory.queries import floats, ints, texts
from controlplane.events import send_event_on_commit
from controlplane.movements.choices import (
    FINISHED,
    IN_FLIGHT,
    TALLY_SCRUB,
    MovementKind,
    MovementReason,
    MovementState,
)
from controlplane.movements.errors import MovementError
from controlplane.movements.models import Movement
from controlplane.movements.planner import (
    MAX_PER_TIER,
    MOVEMENT_TABLE,
    ManagedTier,
    PlannedMovement,
    PlanResult,
    in_flight_add,
    managed_tiers,
    node_group,
    plan_movements,
    warm_movements,
)
from controlplane.movements.quota_pass import plan_quotas
from controlplane.movements.selectors import warm_candidates
from controlplane.policies.selectors import snapshot_current
from controlplane.policies.snapshot import policies_snapshot
from controlplane.policies.specs import PolicySnapshot

log = logging.getLogger("strata.movements")

DISPATCH_BATCH = 32
"""Movements per task message: few enough that a redelivered message redoes little, many enough
that a plan of thousands of blocks is not thousands of broker round trips."""

TALLY_TABLE = "movements_movementtally"
RECOUNT_TABLE = "movements_tierrecount"

_RECORD_SQL = f"""
INSERT INTO {MOVEMENT_TABLE} (plan, block_id, kind, reason, state, src_placement_id, src_epoch, src_tier,
                              src_node, dst_tier, dst_node, exec_node, attempts, policy_version, mode, bytes,
                              detail, error, created_at)
SELECT %(plan)s, r.block_id, r.kind, r.reason, '{MovementState.PLANNED.value}', r.src_placement_id, r.src_epoch,
       r.src_tier, r.src_node, r.dst_tier, r.dst_node, r.exec_node, 0, %(policy_version)s, %(mode)s, r.bytes,
       r.detail, '', %(now)s
FROM unnest(%(block_ids)s::bigint[], %(kinds)s::text[], %(reasons)s::text[], %(src_ids)s::bigint[],
            %(src_epochs)s::bigint[], %(src_tiers)s::text[], %(src_nodes)s::text[], %(dst_tiers)s::text[],
            %(dst_nodes)s::text[], %(exec_nodes)s::text[], %(bytes)s::bigint[], %(details)s::text[])
     AS r(block_id, kind, reason, src_placement_id, src_epoch, src_tier, src_node, dst_tier, dst_node, exec_node,
          bytes, detail)
ORDER BY r.block_id
ON CONFLICT (block_id) WHERE state IN ({",".join(f"'{s.value}'" for s in IN_FLIGHT)}) DO NOTHING
RETURNING id, exec_node, kind
"""


def movements_record(
    *, plan_id: uuid.UUID, movements: Sequence[PlannedMovement], policy_version: int, mode: str, now: datetime
) -> list[int]:
    """Write planned movements and queue them to their nodes once the transaction commits. A block
    that already has a movement in flight is skipped (the partial unique index decides, so two
    planners racing cannot both move one block). Returns the ids written."""
    params: dict[str, Any] = {
        "plan": plan_id,
        "policy_version": policy_version,
        "mode": mode,
        "now": now,
        "block_ids": ints(m.block_id for m in movements),
        "kinds": texts(m.kind for m in movements),
        "reasons": texts(m.reason for m in movements),
        "src_ids": ints(m.src_placement_id for m in movements),
        "src_epochs": ints(m.src_epoch for m in movements),
        "src_tiers": texts(m.src_tier for m in movements),
        "src_nodes": texts(m.src_node for m in movements),
        "dst_tiers": texts(m.dst_tier for m in movements),
        "dst_nodes": texts(m.dst_node for m in movements),
        "exec_nodes": texts(m.exec_node for m in movements),
        "bytes": ints(m.bytes for m in movements),
        "details": texts(m.detail for m in movements),
    }
    with connection.cursor() as cursor:
        cursor.execute(_RECORD_SQL, params)
        rows = cursor.fetchall()
    if len(rows) < len(movements):
        log.info("plan %s: %d block(s) already had a movement in flight; skipped", plan_id, len(movements) - len(rows))
    batches: dict[tuple[str, str], list[int]] = defaultdict(list)
    for ident, exec_node, kind in rows:
        batches[(exec_node, kind)].append(ident)
    transaction.on_commit(lambda: movements_dispatch(batches=dict(batches)))
    moved = [m for m in movements if m.kind != MovementKind.EVICT]
    send_event_on_commit(
        kind="movement.planned",
        payload={
            "plan": str(plan_id),
            "reason": movements[0].reason if movements else "",
            "written": len(rows),
            "moves": len(moved),
            "evictions": len(movements) - len(moved),
            "bytes": sum(m.bytes for m in movements),
            "policy_version": policy_version,
            "mode": mode,
        },
    )
    return sorted(ident for ident, _, _ in rows)


def movements_dispatch(*, batches: dict[tuple[str, str], list[int]]) -> int:
    """Send movements to their nodes' queues (node.move / node.evict / node.warm, a batch of ids
    per message) and mark the ones still planned as dispatched. A send that fails leaves them
    planned: the redispatch sweep sends them again. Returns how many were sent."""
    sent: list[int] = []
    for (exec_node, kind), ids in sorted(batches.items()):
        for start in range(0, len(ids), DISPATCH_BATCH):
            chunk = ids[start : start + DISPATCH_BATCH]
            try:
                app.send_task(f"node.{kind}", args=[chunk], queue=f"node.{exec_node}")
            except Exception as exc:  # noqa: BLE001 - the broker is down: the sweep retries later
                log.warning(
                    "could not queue %d %s movement(s) to node %s: %s; they stay planned",
                    len(chunk),
                    kind,
                    exec_node,
                    exc,
                )
                continue
            sent.extend(chunk)
    if sent:
        # A node may already be starting these (it locks a wave of them in one transaction): skip
        # the rows it holds instead of waiting, or the two lock orders can deadlock. Those become
        # running anyway; a wave that rolls back leaves them planned, which the sweep also re-sends.
        with transaction.atomic():
            free = list(
                Movement.objects.select_for_update(skip_locked=True)
                .filter(id__in=sent, state=MovementState.PLANNED)
                .order_by("id")
                .values_list("id", flat=True)
            )
            Movement.objects.filter(id__in=free).update(state=MovementState.DISPATCHED, dispatched_at=timezone.now())
    return len(sent)


@transaction.atomic
def movement_start(*, movement_id: int, node: str, now: datetime | None = None) -> Movement | None:
    """The node begins (or, after a lost worker, resumes) a movement. Returns None when there is
    nothing to do: it finished already (a duplicate delivery) or does not exist."""
    return movements_start_many(movement_ids=[movement_id], node=node, now=now)[0]


def movements_start_many(
    *, movement_ids: Sequence[int], node: str, now: datetime | None = None
) -> list[Movement | None]:
    """`movement_start` for a node's wave of movements: one locking read (in id order, so two
    attempts of one batch queue instead of deadlocking) and one update for all of them. Returns
    them in the order given, None for each that finished already or does not exist. A movement of
    another node refuses the whole call (MovementError), as it refuses the single form.

    The bulk services run once per wave inside the node's wave transaction and take no savepoint
    of their own there (two round trips per wave): a refusal changes nothing and leaves the
    caller's transaction usable; a database error fails it, as it would fail any statement."""
    with transaction.atomic(savepoint=False):
        locked = {m.id: m for m in Movement.objects.select_for_update().filter(id__in=movement_ids).order_by("id")}
        starting = {m.id: m for m in locked.values() if m.state not in FINISHED}
        foreign = next((m for m in starting.values() if m.exec_node != node), None)
        if starting and foreign is None:
            now = now or timezone.now()
            Movement.objects.filter(id__in=list(starting)).update(
                state=MovementState.RUNNING, attempts=F("attempts") + 1, started_at=now
            )
            for movement in starting.values():
                movement.state, movement.attempts, movement.started_at = (
                    MovementState.RUNNING,
                    movement.attempts + 1,
                    now,
                )
    if foreign is not None:
        raise MovementError(
            f"node: movement {foreign.id} belongs to node {foreign.exec_node!r}, not {node!r}", field="node"
        )
    for ident in movement_ids:
        if ident not in locked:
            log.warning("movement %d does not exist; nothing to do", ident)
    return [starting.get(ident) for ident in movement_ids]


@transaction.atomic
def movement_set_target(*, movement_id: int, placement_id: int) -> None:
    """Remember the target copy a node reserved, so a resumed attempt finds it."""
    movements_set_targets(targets=[(movement_id, placement_id)])


@transaction.atomic(savepoint=False)  # no savepoint of its own, as movements_start_many
def movements_set_targets(*, targets: Sequence[tuple[int, int]]) -> None:
    """`movement_set_target` for a wave: (movement id, placement id) pairs, one statement."""
    if not targets:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {MOVEMENT_TABLE} m SET dst_placement_id = r.placement_id "
            "FROM unnest(%s::bigint[], %s::bigint[]) AS r(id, placement_id) WHERE m.id = r.id",
            [ints(m for m, _ in targets), ints(p for _, p in targets)],
        )


def _tally(
    cursor: Any, *, kind: str, src_tier: str, dst_tier: str, reason: str, result: str, blocks: int, nbytes: int
) -> None:
    cursor.execute(
        f"INSERT INTO {TALLY_TABLE} AS t (kind, src_tier, dst_tier, reason, result, blocks, bytes) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (kind, src_tier, dst_tier, reason, result) "
        "DO UPDATE SET blocks = t.blocks + EXCLUDED.blocks, bytes = t.bytes + EXCLUDED.bytes",
        [kind, src_tier, dst_tier, reason, result, blocks, nbytes],
    )


@dataclasses.dataclass(frozen=True)
class MovementResult:
    """How one movement ended, as `movement_finish` takes it."""

    movement_id: int
    state: str
    nbytes: int | None = None
    duration_s: float | None = None
    detail: str = ""
    error: str = ""


_MOVEMENT_COLUMNS = ", ".join(f'm."{f.column}"' for f in Movement._meta.concrete_fields)
_FINISHED_SQL = ", ".join(f"'{s.value}'" for s in FINISHED)

# One statement: lock the unfinished movements in id order (two attempts finishing one batch
# queue instead of deadlocking), record their results, and add them to the tallies (grouped, in
# label order, so concurrent finishers lock tally rows in one order too).
_FINISH_MANY_SQL = f"""
WITH r AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(states)s::text[], %(bytes)s::bigint[], %(durations)s::float8[],
                         %(details)s::text[], %(errors)s::text[])
         AS r(id, state, bytes, duration_s, detail, error)
), locked AS (
    SELECT m.id FROM {MOVEMENT_TABLE} m JOIN r ON r.id = m.id
    WHERE m.state NOT IN ({_FINISHED_SQL})
    ORDER BY m.id
    FOR UPDATE OF m
), finished AS (
    UPDATE {MOVEMENT_TABLE} m
    SET state = r.state, finished_at = %(now)s, bytes = COALESCE(r.bytes, m.bytes), duration_s = r.duration_s,
        detail = CASE WHEN r.detail <> '' THEN r.detail ELSE m.detail END, error = r.error
    FROM r JOIN locked ON locked.id = r.id
    WHERE m.id = r.id
    RETURNING {_MOVEMENT_COLUMNS}
), tallied AS (
    INSERT INTO {TALLY_TABLE} AS t (kind, src_tier, dst_tier, reason, result, blocks, bytes)
    SELECT kind, src_tier, dst_tier, reason, state, count(*),
           coalesce(sum(bytes) FILTER (WHERE state = '{MovementState.DONE.value}'), 0)
    FROM finished
    GROUP BY kind, src_tier, dst_tier, reason, state
    ORDER BY kind, src_tier, dst_tier, reason, state
    ON CONFLICT (kind, src_tier, dst_tier, reason, result)
    DO UPDATE SET blocks = t.blocks + EXCLUDED.blocks, bytes = t.bytes + EXCLUDED.bytes
)
SELECT * FROM finished
"""


@transaction.atomic
def movement_finish(
    *,
    movement_id: int,
    state: str,
    nbytes: int | None = None,
    duration_s: float | None = None,
    detail: str = "",
    error: str = "",
    now: datetime | None = None,
) -> Movement | None:
    """Record a movement's result and add it to the tallies, in one transaction. Finishing a
    finished movement changes nothing (returns None)."""
    result = MovementResult(
        movement_id=movement_id, state=state, nbytes=nbytes, duration_s=duration_s, detail=detail, error=error
    )
    return movements_finish_many(results=[result], now=now)[0]


def movements_finish_many(*, results: Sequence[MovementResult], now: datetime | None = None) -> list[Movement | None]:
    """`movement_finish` for a node's wave: every result recorded and tallied in one statement
    instead of three and a savepoint per movement. Returns the movements in the order given, None
    for each that had finished already (a duplicate delivery: it changes nothing, not even a
    tally). A result that is not a finished state, or a movement named twice, refuses the call
    before it writes (no savepoint of its own, as movements_start_many)."""
    for i, result in enumerate(results):
        if result.state not in FINISHED:
            raise MovementError(
                f"state: a movement finishes as {', '.join(FINISHED)}, not {result.state!r}",
                field="state" if len(results) == 1 else f"results[{i}].state",
            )
    if len({r.movement_id for r in results}) != len(results):
        raise MovementError("results: a movement is named twice", field="results")
    if not results:
        return []
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(
            _FINISH_MANY_SQL,
            {
                "now": now or timezone.now(),
                "ids": ints(r.movement_id for r in results),
                "states": texts(r.state for r in results),
                "bytes": ints(r.nbytes for r in results),
                "durations": floats(r.duration_s for r in results),
                "details": texts(r.detail for r in results),
                "errors": texts(r.error for r in results),
            },
        )
        names = [f.attname for f in Movement._meta.concrete_fields]
        finished = {m.id: m for m in (Movement.from_db(connection.alias, names, row) for row in cursor.fetchall())}
    return [finished.get(r.movement_id) for r in results]


@transaction.atomic
def checksum_failures_count(*, tier: str, count: int = 1, found_by: str = "scrub") -> None:
    """Count copies found corrupt or missing (by a scrub, a move's verified read, or the reconciler)."""
    if count <= 0:
        return
    with connection.cursor() as cursor:
        _tally(
            cursor,
            kind=TALLY_SCRUB,
            src_tier=tier,
            dst_tier="",
            reason=found_by,
            result="corrupt",
            blocks=count,
            nbytes=0,
        )


def tier_recount_record(
    *, node: str | None, tier: str, drift_bytes: int, drift_blocks: int, now: datetime | None = None
) -> None:
    """Record a recount of a tier's usage counters (`node` None: the shared remote tier): its
    drift (counted minus held) becomes the tier's last, and a drift counts as a correction."""
    corrected = bool(drift_bytes or drift_blocks)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {RECOUNT_TABLE} AS t (node, tier, drift_bytes, drift_blocks, corrections, corrected_bytes, "
            "recounted_at) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (node, tier) DO UPDATE SET "
            "drift_bytes = EXCLUDED.drift_bytes, drift_blocks = EXCLUDED.drift_blocks, recounted_at = "
            "EXCLUDED.recounted_at, corrections = t.corrections + EXCLUDED.corrections, "
            "corrected_bytes = t.corrected_bytes + EXCLUDED.corrected_bytes",
            [node or "", tier, drift_bytes, drift_blocks, int(corrected), abs(drift_bytes), now or timezone.now()],
        )


def movements_finished_announce(
    *, node: str, done: int, failed: int, cancelled: int, nbytes: int, routes: dict[str, int]
) -> None:
    """One dashboard event for a batch of finished movements of a node (never one per block)."""
    send_event_on_commit(
        kind="movement.finished",
        payload={
            "node": node,
            "done": done,
            "failed": failed,
            "cancelled": cancelled,
            "bytes": nbytes,
            "routes": routes,
        },
    )


def _lock_tier(cursor: Any, tier: ManagedTier) -> None:
    """Serialise planners of the same tier for the rest of the transaction: a second planner
    waits, then sees the first one's movements as in flight and does not pick the same bytes."""
    cursor.execute(
        "SELECT pg_advisory_xact_lock(%s, %s)",
        [0x5354524D, zlib.crc32(f"{tier.node}/{tier.tier}".encode()) & 0x7FFFFFFF],
    )


def movements_plan(
    *,
    snapshot: PolicySnapshot | None = None,
    node: str | None = None,
    reason: str = MovementReason.SCHEDULE,
    dry_run: bool = False,
    now: datetime | None = None,
    limit_per_tier: int = MAX_PER_TIER,
    quotas_only: bool = False,
) -> PlanResult:
    """Plan movements for every up node (or only `node`) under `snapshot` (the policies in force
    when None): first the quota pass (namespaces over their quota give up their own coldest
    copies, reason `quota`), then the watermark and TTL pass, unless `quotas_only`. A dry run only
    answers what would move; otherwise the tiers it plans are locked, and Movement rows are
    written and dispatched to the nodes' queues when the transaction commits."""
    if reason not in MovementReason.values and not dry_run:  # a dry run's reason is never recorded
        raise MovementError(
            f"reason: unknown reason {reason!r}; expected one of {', '.join(MovementReason.values)}", field="reason"
        )
    if snapshot is None:
        snapshot = policies_snapshot()
    now = now or timezone.now()
    nodes_qs = Node.objects.filter(state=NodeState.UP).prefetch_related("tiers").order_by("name")
    if node is not None:
        if not Node.objects.filter(name=node).exists():
            raise MovementError(f"node: no node named {node!r}", field="node")
        # The shared remote tier's nodes are still needed to execute remote evictions.
        nodes_qs = nodes_qs.filter(name=node)
    result = PlanResult(policy_version=snapshot.version, mode=snapshot.mode, dry_run=dry_run, plan_id=uuid.uuid4())
    # The shared remote tier is always a destination; it is itself planned only in a fleet-wide plan.
    tiers, remote_nodes = managed_tiers(list(nodes_qs), include_remote=True)
    if not tiers:
        return result
    namespaces = dict(Namespace.objects.values_list("id", "name"))
    with transaction.atomic(), connection.cursor() as cursor:
        in_flight_add(cursor, tiers)
        result.movements = plan_quotas(
            cursor,
            snapshot=snapshot,
            tiers=tiers,
            remote_nodes=remote_nodes,
            namespaces=namespaces,
            now=now,
            plan_remote=node is None,
            limit_per_tier=limit_per_tier,
            claim=None if dry_run else _lock_tier,
        )
        if not quotas_only:
            planned, result.tiers = plan_movements(
                cursor,
                snapshot=snapshot,
                tiers=tiers,
                remote_nodes=remote_nodes,
                namespaces=namespaces,
                reason=reason,
                now=now,
                plan_remote=node is None,
                limit_per_tier=limit_per_tier,
                claim=None if dry_run else _lock_tier,
                skip={m.src_placement_id for m in result.movements},
            )
            result.movements += planned
        if not dry_run and result.movements:
            result.written = movements_record(
                plan_id=result.plan_id,
                movements=result.movements,
                policy_version=snapshot.version,
                mode=snapshot.mode,
                now=now,
            )
    if result.movements:
        counts: dict[str, int] = defaultdict(int)
        for m in result.movements:
            counts[m.route] += 1
        log.info(
            "plan %s (%s, policy version %d%s): %s%s",
            result.plan_id,
            reason,
            snapshot.version,
            f", mode {snapshot.mode}" if snapshot.mode else "",
            ", ".join(f"{n} {route}" for route, n in sorted(counts.items())),
            " (dry run)" if dry_run else f"; {len(result.written)} written",
        )
    return result


def movements_run(*, node: str | None = None, reason: str = MovementReason.MANUAL, dry_run: bool = False) -> PlanResult:
    """Run migration now: plan under the policies in force and dispatch (what the REST action and
    the policies app's triggers call)."""
    return movements_plan(node=node, reason=reason, dry_run=dry_run)


def movements_dry_run(*, overrides: dict[str, Any] | None = None, node: str | None = None) -> PlanResult:
    """What the planner would move and evict now under the policies in force with `overrides` (a
    proposal, the same shape as a mode's) laid over them, writing nothing. A bad proposal raises
    PolicyError naming its field; an unknown node, MovementError."""
    snapshot = snapshot_current(overrides=overrides or {})
    return movements_plan(snapshot=snapshot, node=node, reason="dry-run", dry_run=True)


def movements_warm(
    *,
    node: str,
    block_ids: Sequence[int] | None = None,
    namespace: str | None = None,
    limit: int = 256,
    reason: str = MovementReason.SCHEDULE,
    snapshot: PolicySnapshot | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
) -> PlanResult:
    """Warm a node's host tier from the remote tier ahead of a scheduled job: bring up the named
    blocks, or the most accessed remote blocks (of `namespace`) that the node has no local copy
    of, as far as its host tier has room below the high watermark."""
    if reason not in MovementReason.values:
        raise MovementError(f"reason: unknown reason {reason!r}", field="reason")
    if limit < 1:
        raise MovementError("limit: must be at least 1", field="limit")
    snapshot = snapshot or policies_snapshot()
    now = now or timezone.now()
    row = Node.objects.filter(name=node).first()
    if row is None:
        raise MovementError(f"node: no node named {node!r}", field="node")
    host_row = NodeTier.objects.filter(node=row, tier=TierLevel.HOST, available=True).first()
    if host_row is None or host_row.capacity_bytes <= 0:
        raise MovementError(f"node: node {node!r} has no host tier to warm into", field="node")
    spec = snapshot.tier(TierLevel.HOST, node_group=node_group(row))
    host = ManagedTier(
        node=node,
        node_id=row.id,
        tier=TierLevel.HOST,
        group=node_group(row),
        capacity=host_row.capacity_bytes,
        used=host_row.used_bytes,
    )
    result = PlanResult(policy_version=snapshot.version, mode=snapshot.mode, dry_run=dry_run, plan_id=uuid.uuid4())
    with transaction.atomic(), connection.cursor() as cursor:
        in_flight_add(cursor, {(node, TierLevel.HOST): host})
        candidates = warm_candidates(cursor, node_id=row.id, block_ids=block_ids, namespace=namespace, limit=limit)
        result.movements = warm_movements(host=host, spec=spec, candidates=candidates, reason=reason)
        if not dry_run and result.movements:
            result.written = movements_record(
                plan_id=result.plan_id,
                movements=result.movements,
                policy_version=snapshot.version,
                mode=snapshot.mode,
                now=now,
            )
    return result


@transaction.atomic
def movements_redispatch(
    *,
    older_than: timedelta = timedelta(minutes=10),
    running_longer_than: timedelta = timedelta(hours=2),
    now: datetime | None = None,
) -> dict[str, int]:
    """Sweep movements that stopped moving: ones still planned or dispatched after `older_than`
    (or running for longer than any move takes, their retries spent) are queued again when their
    node is up (a duplicate delivery is harmless: the node resumes from what the directory says
    and skips a finished movement) and cancelled when their node is gone, which frees their
    blocks for the next plan."""
    now = now or timezone.now()
    waiting = Q(state__in=[MovementState.PLANNED, MovementState.DISPATCHED], created_at__lt=now - older_than)
    running = Q(state=MovementState.RUNNING, started_at__lt=now - running_longer_than)
    stuck = list(
        Movement.objects.select_for_update(skip_locked=True)
        .filter(waiting | running)
        .values_list("id", "exec_node", "kind")[:5000]
    )
    if not stuck:
        return {"requeued": 0, "cancelled": 0}
    up = set(Node.objects.filter(name__in={n for _, n, _ in stuck}, state=NodeState.UP).values_list("name", flat=True))
    batches: dict[tuple[str, str], list[int]] = defaultdict(list)
    gone: list[int] = []
    for ident, exec_node, kind in stuck:
        if exec_node in up:
            batches[(exec_node, kind)].append(ident)
        else:
            gone.append(ident)
    movements_finish_many(
        results=[
            MovementResult(
                movement_id=ident,
                state=MovementState.CANCELLED,
                error="its node is not up",
                detail="cancelled by the redispatch sweep",
            )
            for ident in gone
        ]
    )
    if batches:
        transaction.on_commit(lambda: movements_dispatch(batches=dict(batches)))
    requeued = sum(len(v) for v in batches.values())
    if requeued or gone:
        log.warning("redispatch sweep: %d movement(s) queued again, %d cancelled (node not up)", requeued, len(gone))
    return {"requeued": requeued, "cancelled": len(gone)}
