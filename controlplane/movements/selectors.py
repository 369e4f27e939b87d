"""Movements reads: the ledger (filtered, index-backed), warm candidates, the metrics' tallies and
tier recounts, and which tiers are over their high watermark."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet

from controlplane.directory.choices import NodeState, PlacementState, TierLevel
from controlplane.directory.models import Namespace, Node
from controlplane.directory.queries import BLOCK_TABLE, PLACEMENT_TABLE, ints
from controlplane.movements.choices import DEMOTION_ORDER, IN_FLIGHT
from controlplane.movements.errors import MovementError
from controlplane.movements.models import Movement, MovementTally, TierRecount
from controlplane.policies.specs import PolicySnapshot

MOVEMENT_ORDERINGS: dict[str, tuple[str, ...]] = {
    "-id": ("-id",),
    "id": ("id",),
}
"""Orderings of the ledger list: creation order either way (ids come from one sequence)."""


def movements_list(
    *,
    state: str | None = None,
    kind: str | None = None,
    reason: str | None = None,
    node: str | None = None,
    src_tier: str | None = None,
    dst_tier: str | None = None,
    block: int | None = None,
    plan: str | None = None,
) -> QuerySet[Movement]:
    """The ledger, filtered; every single filter is an index range scan in id order."""
    movements = Movement.objects.all()
    if state:
        movements = movements.filter(state=state)
    if kind:
        movements = movements.filter(kind=kind)
    if reason:
        movements = movements.filter(reason=reason)
    if node:
        movements = movements.filter(exec_node=node)
    if src_tier:
        movements = movements.filter(src_tier=src_tier)
    if dst_tier is not None:
        movements = movements.filter(dst_tier=dst_tier)
    if block is not None:
        movements = movements.filter(block_id=block)
    if plan:
        movements = movements.filter(plan=plan)
    return movements


def movement_get(*, movement_id: int) -> Movement | None:
    return Movement.objects.filter(id=movement_id).first()


def movements_in_flight(*, block_id: int) -> list[Movement]:
    return list(Movement.objects.filter(block_id=block_id, state__in=IN_FLIGHT))


def movement_tallies() -> list[MovementTally]:
    """Every running total (a few dozen rows whatever the size of the ledger)."""
    return list(MovementTally.objects.all())


_IN_FLIGHT_SQL = "(" + ",".join(f"'{s.value}'" for s in IN_FLIGHT) + ")"

_WARM_SQL = f"""
SELECT p.id, p.epoch, p.size_bytes, p.block_id
FROM {PLACEMENT_TABLE} p
CROSS JOIN LATERAL (SELECT * FROM {BLOCK_TABLE} WHERE id = p.block_id LIMIT 1) AS b
WHERE p.node_id IS NULL AND p.tier = '{TierLevel.REMOTE.value}' AND p.state = '{PlacementState.READY.value}'
  AND (%(any_block)s OR p.block_id = ANY(%(block_ids)s::bigint[]))
  AND (%(namespace_id)s::bigint IS NULL OR b.namespace_id = %(namespace_id)s::bigint)
  AND NOT EXISTS (SELECT 1 FROM {PLACEMENT_TABLE} l
                  WHERE l.block_id = p.block_id AND l.node_id = %(node_id)s
                    AND l.tier IN ('{TierLevel.HOST.value}', '{TierLevel.DISK.value}'))
  AND NOT EXISTS (SELECT 1 FROM movements_movement m WHERE m.block_id = p.block_id AND m.state IN {_IN_FLIGHT_SQL})
ORDER BY b.access_count DESC, b.last_access_at DESC, p.block_id
LIMIT %(limit)s
"""


def warm_candidates(
    cursor: Any, *, node_id: int, block_ids: Sequence[int] | None, namespace: str | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """Remote copies worth bringing to a node: (placement id, epoch, size, block id), most used first."""
    namespace_id = None
    if namespace is not None:
        namespace_id = Namespace.objects.filter(name=namespace).values_list("id", flat=True).first()
        if namespace_id is None:
            raise MovementError(f"namespace: no namespace named {namespace!r}", field="namespace")
    cursor.execute(
        _WARM_SQL,
        {
            "node_id": node_id,
            "any_block": block_ids is None,
            "block_ids": ints(block_ids or []),
            "namespace_id": namespace_id,
            "limit": limit,
        },
    )
    return [tuple(row) for row in cursor.fetchall()]  # type: ignore[misc]


def nodes_over_watermark(*, snapshot: PolicySnapshot) -> tuple[list[str], bool]:
    """Up nodes with a managed local tier over its high watermark, and whether the shared remote
    tier is (from the nodes' last heartbeats: one small query, no block is read)."""
    over: list[str] = []
    remote_over = False
    for node in Node.objects.filter(state=NodeState.UP).prefetch_related("tiers").order_by("name"):
        group = getattr(node, "group", "") or ""
        for t in node.tiers.all():
            if t.tier not in DEMOTION_ORDER or not t.available or t.capacity_bytes <= 0:
                continue
            spec = snapshot.tier(t.tier, node_group="" if t.tier == TierLevel.REMOTE else group)
            if t.used_bytes > spec.high_water_bytes(t.capacity_bytes):
                if t.tier == TierLevel.REMOTE:
                    remote_over = True
                elif node.name not in over:
                    over.append(node.name)
    return over, remote_over


def tier_recounts() -> list[TierRecount]:
    """The last recount of every tier the reconcile job has recounted (a row per node and tier)."""
    return list(TierRecount.objects.all())
