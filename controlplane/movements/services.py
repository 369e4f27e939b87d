"""Movements writes: record and dispatch planned movements, move them through their states, keep
the metrics' tallies, and the operator's "run migration now"."""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.dashboard.events import send_event_on_commit
from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.directory.queries import ints, texts
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
    MOVEMENT_TABLE,
    PlannedMovement,
    PlanResult,
    plan,
    warm_plan,
)

log = logging.getLogger("strata.movements")

DISPATCH_BATCH = 32
"""Movements per task message: few enough that a redelivered message redoes little, many enough
that a plan of thousands of blocks is not thousands of broker round trips."""

TALLY_TABLE = "movements_movementtally"

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


def movements_record(*, plan_id: uuid.UUID, movements: Sequence[PlannedMovement], policy_version: int, mode: str,
                     now: datetime) -> list[int]:
    """Write planned movements and queue them to their nodes once the transaction commits. A block
    that already has a movement in flight is skipped (the partial unique index decides, so two
    planners racing cannot both move one block). Returns the ids written."""
    params: dict[str, Any] = {
        "plan": plan_id, "policy_version": policy_version, "mode": mode, "now": now,
        "block_ids": ints(m.block_id for m in movements), "kinds": texts(m.kind for m in movements),
        "reasons": texts(m.reason for m in movements), "src_ids": ints(m.src_placement_id for m in movements),
        "src_epochs": ints(m.src_epoch for m in movements), "src_tiers": texts(m.src_tier for m in movements),
        "src_nodes": texts(m.src_node for m in movements), "dst_tiers": texts(m.dst_tier for m in movements),
        "dst_nodes": texts(m.dst_node for m in movements), "exec_nodes": texts(m.exec_node for m in movements),
        "bytes": ints(m.bytes for m in movements), "details": texts(m.detail for m in movements),
    }
    with connection.cursor() as cursor:
        cursor.execute(_RECORD_SQL, params)
        rows = cursor.fetchall()
    if len(rows) < len(movements):
        log.info("plan %s: %d block(s) already had a movement in flight; skipped", plan_id,
                 len(movements) - len(rows))
    batches: dict[tuple[str, str], list[int]] = defaultdict(list)
    for ident, exec_node, kind in rows:
        batches[(exec_node, kind)].append(ident)
    transaction.on_commit(lambda: movements_dispatch(batches=dict(batches)))
    moved = [m for m in movements if m.kind != MovementKind.EVICT]
    send_event_on_commit(kind="movement.planned", payload={
        "plan": str(plan_id), "reason": movements[0].reason if movements else "", "written": len(rows),
        "moves": len(moved), "evictions": len(movements) - len(moved),
        "bytes": sum(m.bytes for m in movements), "policy_version": policy_version, "mode": mode})
    return sorted(ident for ident, _, _ in rows)


def movements_dispatch(*, batches: dict[tuple[str, str], list[int]]) -> int:
    """Send movements to their nodes' queues (node.move / node.evict / node.warm, a batch of ids
    per message) and mark the ones still planned as dispatched. A send that fails leaves them
    planned: the redispatch sweep sends them again. Returns how many were sent."""
    from controlplane.celery_app import app

    sent: list[int] = []
    for (exec_node, kind), ids in sorted(batches.items()):
        for start in range(0, len(ids), DISPATCH_BATCH):
            chunk = ids[start:start + DISPATCH_BATCH]
            try:
                app.send_task(f"node.{kind}", args=[chunk], queue=f"node.{exec_node}")
            except Exception as exc:  # noqa: BLE001 - the broker is down: the sweep retries later
                log.warning("could not queue %d %s movement(s) to node %s: %s; they stay planned",
                            len(chunk), kind, exec_node, exc)
                continue
            sent.extend(chunk)
    if sent:
        # A node may already be starting these (it locks a wave of them in one transaction): skip
        # the rows it holds instead of waiting, or the two lock orders can deadlock. Those become
        # running anyway; a wave that rolls back leaves them planned, which the sweep also re-sends.
        with transaction.atomic():
            free = list(Movement.objects.select_for_update(skip_locked=True)
                        .filter(id__in=sent, state=MovementState.PLANNED).order_by("id").values_list("id", flat=True))
            Movement.objects.filter(id__in=free).update(state=MovementState.DISPATCHED, dispatched_at=timezone.now())
    return len(sent)


@transaction.atomic
def movement_start(*, movement_id: int, node: str, now: datetime | None = None) -> Movement | None:
    """The node begins (or, after a lost worker, resumes) a movement. Returns None when there is
    nothing to do: it finished already (a duplicate delivery) or does not exist."""
    movement = Movement.objects.select_for_update().filter(id=movement_id).first()
    if movement is None:
        log.warning("movement %d does not exist; nothing to do", movement_id)
        return None
    if movement.state in FINISHED:
        return None
    if movement.exec_node != node:
        raise MovementError(f"node: movement {movement_id} belongs to node {movement.exec_node!r}, not {node!r}",
                            field="node")
    movement.state = MovementState.RUNNING
    movement.attempts += 1
    movement.started_at = now or timezone.now()
    movement.save(update_fields=["state", "attempts", "started_at"])
    return movement


@transaction.atomic
def movement_set_target(*, movement_id: int, placement_id: int) -> None:
    """Remember the target copy a node reserved, so a resumed attempt finds it."""
    Movement.objects.filter(id=movement_id).update(dst_placement_id=placement_id)


def _tally(cursor: Any, *, kind: str, src_tier: str, dst_tier: str, reason: str, result: str, blocks: int,
           nbytes: int) -> None:
    cursor.execute(
        f"INSERT INTO {TALLY_TABLE} AS t (kind, src_tier, dst_tier, reason, result, blocks, bytes) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (kind, src_tier, dst_tier, reason, result) "
        "DO UPDATE SET blocks = t.blocks + EXCLUDED.blocks, bytes = t.bytes + EXCLUDED.bytes",
        [kind, src_tier, dst_tier, reason, result, blocks, nbytes],
    )


@transaction.atomic
def movement_finish(*, movement_id: int, state: str, nbytes: int | None = None, duration_s: float | None = None,
                    detail: str = "", error: str = "", now: datetime | None = None) -> Movement | None:
    """Record a movement's result and add it to the tallies, in one transaction. Finishing a
    finished movement changes nothing (returns None)."""
    if state not in FINISHED:
        raise MovementError(f"state: a movement finishes as {', '.join(FINISHED)}, not {state!r}", field="state")
    movement = Movement.objects.select_for_update().filter(id=movement_id).first()
    if movement is None or movement.state in FINISHED:
        return None
    movement.state = state
    movement.finished_at = now or timezone.now()
    if nbytes is not None:
        movement.bytes = nbytes
    movement.duration_s = duration_s
    if detail:
        movement.detail = detail
    movement.error = error
    movement.save(update_fields=["state", "finished_at", "bytes", "duration_s", "detail", "error"])
    with connection.cursor() as cursor:
        _tally(cursor, kind=movement.kind, src_tier=movement.src_tier, dst_tier=movement.dst_tier,
               reason=movement.reason, result=state, blocks=1, nbytes=movement.bytes if state == "done" else 0)
    return movement


@transaction.atomic
def checksum_failures_count(*, tier: str, count: int = 1, found_by: str = "scrub") -> None:
    """Count copies found corrupt or missing (by a scrub, a move's verified read, or the reconciler)."""
    if count <= 0:
        return
    with connection.cursor() as cursor:
        _tally(cursor, kind=TALLY_SCRUB, src_tier=tier, dst_tier="", reason=found_by, result="corrupt",
               blocks=count, nbytes=0)


def movements_finished_announce(*, node: str, done: int, failed: int, cancelled: int, nbytes: int,
                                routes: dict[str, int]) -> None:
    """One dashboard event for a batch of finished movements of a node (never one per block)."""
    send_event_on_commit(kind="movement.finished", payload={
        "node": node, "done": done, "failed": failed, "cancelled": cancelled, "bytes": nbytes, "routes": routes})


def movements_run(*, node: str | None = None, reason: str = MovementReason.MANUAL, dry_run: bool = False) -> PlanResult:
    """Run migration now: plan under the policies in force and dispatch (what the REST action and
    the policies app's triggers call)."""
    return plan(node=node, reason=reason, dry_run=dry_run)


def movements_warm(*, node: str, block_ids: Sequence[int] | None = None, namespace: str | None = None,
                   limit: int = 256, reason: str = MovementReason.SCHEDULE, dry_run: bool = False) -> PlanResult:
    """Warm a node's host tier from the remote tier ahead of a scheduled job."""
    return warm_plan(node=node, block_ids=block_ids, namespace=namespace, limit=limit, reason=reason,
                     dry_run=dry_run)


@transaction.atomic
def movements_redispatch(*, older_than: timedelta = timedelta(minutes=10),
                         running_longer_than: timedelta = timedelta(hours=2),
                         now: datetime | None = None) -> dict[str, int]:
    """Sweep movements that stopped moving: ones still planned or dispatched after `older_than`
    (or running for longer than any move takes, their retries spent) are queued again when their
    node is up (a duplicate delivery is harmless: the node resumes from what the directory says
    and skips a finished movement) and cancelled when their node is gone, which frees their
    blocks for the next plan."""
    now = now or timezone.now()
    waiting = Q(state__in=[MovementState.PLANNED, MovementState.DISPATCHED], created_at__lt=now - older_than)
    running = Q(state=MovementState.RUNNING, started_at__lt=now - running_longer_than)
    stuck = list(Movement.objects.select_for_update(skip_locked=True).filter(waiting | running)
                 .values_list("id", "exec_node", "kind")[:5000])
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
    for ident in gone:
        movement_finish(movement_id=ident, state=MovementState.CANCELLED, error="its node is not up",
                        detail="cancelled by the redispatch sweep")
    if batches:
        transaction.on_commit(lambda: movements_dispatch(batches=dict(batches)))
    requeued = sum(len(v) for v in batches.values())
    if requeued or gone:
        log.warning("redispatch sweep: %d movement(s) queued again, %d cancelled (node not up)", requeued, len(gone))
    return {"requeued": requeued, "cancelled": len(gone)}
