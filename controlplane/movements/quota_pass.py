"""The planner's quota pass: a namespace over its quota in a tier gives up its own coldest copies there.

For every namespace quota (snapshot.quotas) and every managed tier it caps (each node's host or
disk tier; the shared remote tier once), the pass reads what the namespace's copies hold there
(ready and being written, less what is already leaving) and, over the quota, picks the
namespace's own copies in the tier's eviction order until it is back at its quota. Only that
namespace's copies are ever picked: a tenant that floods a tier never pushes another tenant's
blocks out. A victim moves to the tier the policy demotes to when that tier has room below its
high watermark and the namespace has room under its quota there; otherwise it is evicted. The
pass runs before the watermark pass of the same plan, so a tier under pressure first sheds the
bytes of namespaces over their quota; its victims are skipped by the watermark pass.

Cost: one statement for the use of every namespace with a quota (through the block's
(namespace, model, id) index and the placement's (block, tier, node) index), and one per tier a
namespace is over; both follow what the namespaces hold, not the size of the directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.queries import BLOCK_TABLE, PLACEMENT_TABLE, ints
from controlplane.movements.choices import DEMOTION_ORDER, IN_FLIGHT, MovementKind, MovementReason
from controlplane.movements.planner import (
    MAX_PER_TIER,
    MOVEMENT_TABLE,
    ORDER_KEYS,
    ManagedTier,
    PlannedMovement,
    TierClaim,
    _eviction,
    _next_tiers,
)
from controlplane.policies.specs import QUOTA_TIERS, PolicySnapshot

_IN_FLIGHT_SQL = "(" + ",".join(f"'{s.value}'" for s in IN_FLIGHT) + ")"

QUOTA_USE_SQL = f"""
SELECT b.namespace_id, p.node_id, p.tier, sum(p.size_bytes)
FROM {BLOCK_TABLE} b
JOIN {PLACEMENT_TABLE} p ON p.block_id = b.id
WHERE b.namespace_id = ANY(%(ns_ids)s::bigint[]) AND p.tier = ANY(%(tiers)s::text[])
  AND p.state IN ('{PlacementState.READY.value}', '{PlacementState.PENDING.value}')
  AND NOT EXISTS (SELECT 1 FROM {MOVEMENT_TABLE} m
                  WHERE m.block_id = p.block_id AND m.src_placement_id = p.id
                    AND m.kind <> '{MovementKind.WARM.value}' AND m.state IN {_IN_FLIGHT_SQL})
GROUP BY 1, 2, 3
"""
"""Bytes each namespace's copies hold per (node, tier), less the copies already leaving."""


def quota_victims_sql(*, algorithm: str, remote: bool) -> str:
    """One namespace's ready copies in one tier of one node (the shared remote tier when
    `remote`), coldest first by the tier's algorithm, until `needed` bytes are reached."""
    first, second = ORDER_KEYS[algorithm]
    where_node = "p.node_id IS NULL" if remote else "p.node_id = %(node_id)s"
    return f"""
WITH c AS (
    SELECT p.id, p.epoch, p.size_bytes, p.block_id, ({first})::float8 AS s1, ({second})::float8 AS s2,
           ARRAY(SELECT q.tier::text FROM {PLACEMENT_TABLE} q
                 WHERE q.block_id = p.block_id AND q.id <> p.id AND q.state = '{PlacementState.READY.value}'
                   AND (q.node_id IS NULL OR q.node_id = p.node_id)) AS held_below
    FROM {BLOCK_TABLE} b
    JOIN {PLACEMENT_TABLE} p ON p.block_id = b.id
    WHERE b.namespace_id = %(ns_id)s AND {where_node} AND p.tier = %(tier)s
      AND p.state = '{PlacementState.READY.value}'
      AND NOT (p.id = ANY(%(skip)s::bigint[]))
      AND NOT EXISTS (SELECT 1 FROM {MOVEMENT_TABLE} m
                      WHERE m.block_id = p.block_id AND m.state IN {_IN_FLIGHT_SQL})
), r AS (
    SELECT c.*, sum(c.size_bytes) OVER (ORDER BY s1, s2, block_id ROWS UNBOUNDED PRECEDING) AS running
    FROM c
)
SELECT id, epoch, size_bytes, block_id, held_below
FROM r
WHERE running - size_bytes < %(needed)s
ORDER BY s1, s2, block_id
LIMIT %(limit)s
"""


def quota_use(cursor: Any, *, namespace_ids: Sequence[int]) -> dict[tuple[int, int | None, str], int]:
    """Bytes per (namespace id, node id (None: remote), tier) of the namespaces' copies in the
    quota tiers, not counting copies already leaving."""
    if not namespace_ids:
        return {}
    cursor.execute(QUOTA_USE_SQL, {"ns_ids": ints(sorted(namespace_ids)), "tiers": "{" + ",".join(QUOTA_TIERS) + "}"})
    return {(ns_id, node_id, tier): int(total) for ns_id, node_id, tier, total in cursor.fetchall()}


def _quota_room(quota: int | None, used: int) -> float:
    """Bytes a namespace may still add to a tier (unbounded without a quota)."""
    return float("inf") if quota is None else quota - used


def plan_quotas(
    cursor: Any,
    *,
    snapshot: PolicySnapshot,
    tiers: dict[tuple[str, str], ManagedTier],
    remote_nodes: Sequence[str],
    namespaces: dict[int, str],
    now: datetime,
    plan_remote: bool = True,
    limit_per_tier: int = MAX_PER_TIER,
    claim: TierClaim | None = None,
) -> list[PlannedMovement]:
    """The movements that bring every namespace back under its quota in every tier of `tiers`
    (the remote tier only when `plan_remote`), each with reason `quota`. Adds what leaves and
    arrives to `tiers`' planned bytes, so the watermark pass that follows counts it. Reads
    through `cursor`, writes nothing."""
    if not snapshot.quotas:
        return []
    ids = {name: ident for ident, name in namespaces.items()}
    quotas = {(q.namespace, q.tier): q.bytes for q in snapshot.quotas if q.namespace in ids}
    use = quota_use(cursor, namespace_ids=sorted({ids[name] for name, _ in quotas}))
    movements: list[PlannedMovement] = []
    picked: set[int] = set()
    remote_turn = 0
    # Lowest tier first: what leaves a lower tier makes room (and quota) for what arrives from above.
    loads = sorted(
        (t for t in tiers.values() if t.tier in QUOTA_TIERS and (plan_remote or t.tier != TierLevel.REMOTE)),
        key=lambda t: (-DEMOTION_ORDER.index(t.tier), t.node),
    )
    for load in loads:
        spec = snapshot.tier(load.tier, node_group=load.group)
        for (name, tier), quota in sorted(quotas.items()):
            ns_id = ids[name]
            if tier != load.tier:
                continue
            excess = use.get((ns_id, load.node_id, tier), 0) - quota
            if excess <= 0:
                continue
            if claim is not None:
                claim(cursor, load)
            cursor.execute(
                quota_victims_sql(algorithm=spec.algorithm, remote=load.tier == TierLevel.REMOTE),
                {
                    "ns_id": ns_id,
                    "node_id": load.node_id,
                    "tier": load.tier,
                    "now": now,
                    "needed": excess,
                    "limit": limit_per_tier,
                    "skip": ints(sorted(picked)),
                },
            )
            below = _next_tiers(load, tiers, spec)
            detail = f"namespace {name} over its {tier} quota ({excess + quota} of {quota} bytes)"
            for placement_id, epoch, size, block_id, held_below in cursor.fetchall():
                picked.add(placement_id)
                use[(ns_id, load.node_id, tier)] = use.get((ns_id, load.node_id, tier), 0) - size
                load.planned_out += size
                already = next((t.tier for t in below if t.tier in held_below), None)
                if already is not None:
                    movements.append(
                        _eviction(
                            load,
                            placement_id,
                            epoch,
                            block_id,
                            size,
                            MovementReason.QUOTA,
                            load.node,
                            f"{detail}; a copy is already held in {already}",
                        )
                    )
                    continue
                target = next(
                    (
                        t
                        for t in below
                        if t.room(snapshot.tier(t.tier, node_group=t.group)) >= size
                        and _quota_room(quotas.get((name, t.tier)), use.get((ns_id, t.node_id, t.tier), 0)) >= size
                    ),
                    None,
                )
                if load.tier == TierLevel.REMOTE:
                    exec_node = remote_nodes[remote_turn % len(remote_nodes)]
                    remote_turn += 1
                else:
                    exec_node = load.node
                if target is None:
                    why = "no tier below with room (or quota) for it" if below else "no tier below"
                    movements.append(
                        _eviction(
                            load,
                            placement_id,
                            epoch,
                            block_id,
                            size,
                            MovementReason.QUOTA,
                            exec_node,
                            f"{detail}; {why}",
                        )
                    )
                    continue
                target.planned_in += size
                use[(ns_id, target.node_id, target.tier)] = use.get((ns_id, target.node_id, target.tier), 0) + size
                movements.append(
                    PlannedMovement(
                        block_id=block_id,
                        kind=MovementKind.MOVE,
                        reason=MovementReason.QUOTA,
                        src_placement_id=placement_id,
                        src_epoch=epoch,
                        src_tier=load.tier,
                        src_node=load.node,
                        dst_tier=target.tier,
                        dst_node=target.node,
                        exec_node=exec_node,
                        bytes=size,
                        detail=detail,
                    )
                )
    return movements
