"""The movement planner: which copies leave which tier, and where they go, under the policies in force.

For every node (and once for the shared remote tier) and every managed tier, the planner compares
the tier's reported use (less what is already leaving it) with the policy's watermarks. Over the
high watermark it picks victims until the tier would be back at its low watermark; with a TTL it
also demotes every copy idle for longer. Victims are ordered: expired copies first, then copies
used fewer than `min_accesses` times, then by priority class (lower weight goes first), then by
the tier's eviction algorithm. A victim moves to the policy's demote tier, or else the next tier
below that the node has with room; it is evicted when there is none, or when it is expired and was
used fewer than `min_accesses` times.

Each (node, tier) is one SQL statement: an index range scan of that tier's READY copies (the
placement (node, tier, state) index), the blocks joined by primary key, ranked and cut by a
running sum. Its cost grows with what the tier holds, never with the size of the directory.

The planner only reads: it computes a plan from a cursor, a policy snapshot and the tiers' loads.
`services.movements_plan` / `movements_warm` own the transaction, the advisory locks, recording
and dispatch.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any

from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.models import Node
from controlplane.directory.queries import BLOCK_TABLE, PLACEMENT_TABLE, floats, ints, texts
from controlplane.movements.choices import DEMOTION_ORDER, IN_FLIGHT, MovementKind, MovementReason
from controlplane.movements.errors import MovementError
from controlplane.policies.specs import ALGORITHMS, DEFAULT_CLASS, PolicySnapshot, TierPolicySpec

MOVEMENT_TABLE = "movements_movement"
MAX_PER_TIER = 20_000
"""Most victims one plan picks in one tier; a tier further over its watermark is planned again
by the next run (the beat plans every few seconds)."""

RECOMPUTE_CROSSOVER_TOKENS = 4096.0
"""Context length at which a token's attention costs about as much as the rest of its layer: a
block that deep in a prompt costs twice as much to recompute as one at the start."""

_IN_FLIGHT_SQL = "(" + ",".join(f"'{s.value}'" for s in IN_FLIGHT) + ")"

# Two sort keys per algorithm; lower goes first.
_EPOCH = "extract(epoch from b.last_access_at)"
ORDER_KEYS: dict[str, tuple[str, str]] = {
    "lru": (_EPOCH, "b.id"),
    "lfu": ("b.access_count", _EPOCH),
    # S3-FIFO: copies never used again since they were written leave first, in the order they came
    # (a FIFO); copies used again leave least recently used first.
    "s3fifo": (
        "(b.access_count > 0)::int",
        f"CASE WHEN b.access_count > 0 THEN {_EPOCH} ELSE extract(epoch from b.created_at) END",
    ),
    # Value of keeping a copy per byte: reuse likelihood (accesses, decaying with idle hours) times
    # the cost of recomputing the block (its tokens, dearer deeper in a prompt) over its size.
    "cost-aware": (
        "((b.access_count + 1) / (1 + extract(epoch from (%(now)s - b.last_access_at)) / 3600.0))"
        f" * (b.token_count * (1 + b.position / {RECOMPUTE_CROSSOVER_TOKENS}))"
        " / greatest(p.size_bytes, 1)",
        _EPOCH,
    ),
}


def candidates_sql(*, algorithm: str, remote: bool) -> str:
    """The victim query of one tier of one node (the shared remote tier when `remote`)."""
    if algorithm not in ORDER_KEYS:
        raise MovementError(
            f"algorithm: unknown eviction algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}",
            field="algorithm",
        )
    first, second = ORDER_KEYS[algorithm]
    where_node = "p.node_id IS NULL" if remote else "p.node_id = %(node_id)s"
    order = "expired DESC, below_min DESC, weight, s1, s2, block_id"
    return f"""
WITH c AS (
    SELECT p.id, p.epoch, p.size_bytes, p.block_id,
           (%(ttl)s::float8 IS NOT NULL
            AND b.last_access_at < %(now)s - make_interval(secs => %(ttl)s::float8)) AS expired,
           b.access_count < %(min_accesses)s AS below_min,
           COALESCE((%(class_weights)s::float8[])[array_position(%(class_names)s::text[], b.priority::text)],
                    (%(ns_weights)s::float8[])[array_position(%(ns_ids)s::bigint[], b.namespace_id)],
                    %(default_weight)s::float8) AS weight,
           ({first})::float8 AS s1, ({second})::float8 AS s2,
           -- Tiers below that already hold a servable copy (this node's or the shared remote one):
           -- such a victim needs no copy, only its eviction here.
           ARRAY(SELECT q.tier::text FROM {PLACEMENT_TABLE} q
                 WHERE q.block_id = p.block_id AND q.id <> p.id AND q.state = '{PlacementState.READY.value}'
                   AND (q.node_id IS NULL OR q.node_id = p.node_id)) AS held_below
    FROM {PLACEMENT_TABLE} p
    -- LIMIT 1 keeps this a primary-key probe per copy: as a plain join the planner may hash the
    -- whole block table, whose size has nothing to do with this tier.
    CROSS JOIN LATERAL (SELECT * FROM {BLOCK_TABLE} WHERE id = p.block_id LIMIT 1) AS b
    WHERE {where_node} AND p.tier = %(tier)s AND p.state = '{PlacementState.READY.value}'
      AND NOT (p.id = ANY(%(skip)s::bigint[]))
      AND NOT EXISTS (SELECT 1 FROM {MOVEMENT_TABLE} m
                      WHERE m.block_id = p.block_id AND m.state IN {_IN_FLIGHT_SQL})
), r AS (
    SELECT c.*, sum(c.size_bytes) OVER (ORDER BY {order} ROWS UNBOUNDED PRECEDING) AS running
    FROM c
)
SELECT id, epoch, size_bytes, block_id, expired, below_min, held_below
FROM r
WHERE expired OR running - size_bytes < %(needed)s
ORDER BY {order}
LIMIT %(limit)s
"""


def candidates_params(
    *,
    snapshot: PolicySnapshot,
    spec: TierPolicySpec,
    node_id: int | None,
    tier: str,
    needed: int,
    now: datetime,
    namespaces: dict[int, str],
    limit: int = MAX_PER_TIER,
    skip: Collection[int] = (),
) -> dict[str, Any]:
    """Parameters of `candidates_sql`. A block's class is the one its `priority` names, or else
    its namespace's class; weights come from the snapshot. Copies in `skip` (ids) are already
    leaving in this plan."""
    classes = [c for c in snapshot.classes if c.name != DEFAULT_CLASS]
    default = snapshot.class_of_namespace("\0no namespace\0")
    ns_ids = sorted(namespaces)
    return {
        "node_id": node_id,
        "tier": tier,
        "now": now,
        "ttl": float(spec.ttl_seconds) if spec.ttl_seconds else None,
        "min_accesses": int(spec.min_accesses or 0),
        "class_names": texts(c.name for c in classes),
        "class_weights": floats(c.weight for c in classes),
        "ns_ids": ints(ns_ids),
        "ns_weights": floats(snapshot.class_of_namespace(namespaces[i]).weight for i in ns_ids),
        "default_weight": float(default.weight),
        "needed": int(max(needed, 0)),
        "limit": int(limit),
        "skip": ints(sorted(skip)),
    }


@dataclasses.dataclass(frozen=True)
class PlannedMovement:
    """One movement the planner chose (the service records it as a Movement row unless it is a dry run)."""

    block_id: int
    kind: str
    reason: str
    src_placement_id: int
    src_epoch: int
    src_tier: str
    src_node: str
    dst_tier: str
    dst_node: str
    exec_node: str
    bytes: int
    detail: str = ""

    @property
    def route(self) -> str:
        return f"{self.src_tier}->{self.dst_tier or 'evicted'}"


@dataclasses.dataclass
class ManagedTier:
    """One managed tier of one node (or the shared remote tier) as the planner sees it: its
    capacity and use, what is in flight out of and into it, and what this plan adds."""

    node: str
    node_id: int | None
    tier: str
    group: str
    capacity: int
    """As the node reported it; the policy may cap it (TierPolicySpec.effective_capacity_bytes)."""
    used: int
    leaving: int = 0
    arriving: int = 0
    planned_out: int = 0
    planned_in: int = 0

    @property
    def effective_used(self) -> int:
        return self.used - self.leaving - self.planned_out + self.arriving + self.planned_in

    def room(self, spec: TierPolicySpec) -> int:
        """Bytes this tier can take before it reaches its high watermark."""
        return spec.high_water_bytes(self.capacity) - self.effective_used


@dataclasses.dataclass
class PlanResult:
    """What a plan chose, and (unless a dry run) which Movement rows it wrote."""

    policy_version: int
    mode: str
    dry_run: bool
    plan_id: uuid.UUID
    movements: list[PlannedMovement] = dataclasses.field(default_factory=list)
    written: list[int] = dataclasses.field(default_factory=list)
    """Ids of the Movement rows written (movements of blocks already in flight are skipped)."""
    tiers: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts and bytes by kind and route, as the dry-run endpoint and the run action answer."""
        by_route: dict[str, dict[str, int]] = {}
        moves = evictions = bytes_moved = bytes_evicted = 0
        for m in self.movements:
            route = by_route.setdefault(m.route, {"blocks": 0, "bytes": 0})
            route["blocks"] += 1
            route["bytes"] += m.bytes
            if m.kind == MovementKind.EVICT:
                evictions += 1
                bytes_evicted += m.bytes
            else:
                moves += 1
                bytes_moved += m.bytes
        return {
            "plan": str(self.plan_id),
            "policy_version": self.policy_version,
            "mode": self.mode,
            "dry_run": self.dry_run,
            "moves": moves,
            "evictions": evictions,
            "bytes_moved": bytes_moved,
            "bytes_evicted": bytes_evicted,
            "by_route": dict(sorted(by_route.items())),
            "written": len(self.written),
            "tiers": self.tiers,
        }


def node_group(node: Node) -> str:
    """The node group a node's tier policies are chosen by ("" when it has none)."""
    return getattr(node, "group", "") or ""


def managed_tiers(
    nodes: Sequence[Node], *, include_remote: bool
) -> tuple[dict[tuple[str, str], ManagedTier], list[str]]:
    """Managed tiers per node from their last heartbeat (`nodes` with their tiers prefetched),
    plus the shared remote tier (its largest reported capacity and use: every node sees the same
    store). Returns the tiers keyed by (node, tier) and the nodes that can execute remote work."""
    tiers: dict[tuple[str, str], ManagedTier] = {}
    remote_nodes: list[str] = []
    remote_capacity = remote_used = 0
    for node in nodes:
        for t in node.tiers.all():
            if not t.available or t.capacity_bytes <= 0 or t.tier not in DEMOTION_ORDER:
                continue
            if t.tier == TierLevel.REMOTE:
                remote_nodes.append(node.name)
                remote_capacity = max(remote_capacity, t.capacity_bytes)
                remote_used = max(remote_used, t.used_bytes)
                continue
            tiers[(node.name, t.tier)] = ManagedTier(
                node=node.name,
                node_id=node.id,
                tier=t.tier,
                group=node_group(node),
                capacity=t.capacity_bytes,
                used=t.used_bytes,
            )
    if remote_nodes and include_remote:
        tiers[("", TierLevel.REMOTE)] = ManagedTier(
            node="", node_id=None, tier=TierLevel.REMOTE, group="", capacity=remote_capacity, used=remote_used
        )
    return tiers, sorted(remote_nodes)


def in_flight_add(cursor: Any, tiers: dict[tuple[str, str], ManagedTier]) -> None:
    """Add the bytes already leaving or arriving at each tier (movements not finished yet)."""
    cursor.execute(
        f"SELECT src_node, src_tier, dst_node, dst_tier, sum(bytes) FROM {MOVEMENT_TABLE} "
        f"WHERE state IN {_IN_FLIGHT_SQL} GROUP BY 1, 2, 3, 4"
    )
    for src_node, src_tier, dst_node, dst_tier, total in cursor.fetchall():
        source = tiers.get((src_node, src_tier))
        if source is not None:
            source.leaving += int(total)
        target = tiers.get((dst_node, dst_tier)) if dst_tier else None
        if target is not None:
            target.arriving += int(total)


def leaving_bytes(cursor: Any, tier: ManagedTier) -> int:
    """Bytes of movements in flight out of `tier` now."""
    cursor.execute(
        f"SELECT coalesce(sum(bytes), 0) FROM {MOVEMENT_TABLE} WHERE state IN {_IN_FLIGHT_SQL} "
        "AND src_node = %s AND src_tier = %s",
        [tier.node, tier.tier],
    )
    return int(cursor.fetchone()[0])


def _eviction(
    load: ManagedTier, placement_id: int, epoch: int, block_id: int, size: int, why: str, exec_node: str, detail: str
) -> PlannedMovement:
    """An eviction of one copy from `load`'s tier: dropped, not copied anywhere, run on `exec_node`."""
    return PlannedMovement(
        block_id=block_id,
        kind=MovementKind.EVICT,
        reason=why,
        src_placement_id=placement_id,
        src_epoch=epoch,
        src_tier=load.tier,
        src_node=load.node,
        dst_tier="",
        dst_node="",
        exec_node=exec_node,
        bytes=size,
        detail=detail,
    )


def _next_tiers(
    load: ManagedTier, tiers: dict[tuple[str, str], ManagedTier], spec: TierPolicySpec
) -> list[ManagedTier]:
    """Tiers a victim of `load` may go to, in order of preference: the policy's demote tier, or
    else every slower tier the node has, nearest first."""
    below = DEMOTION_ORDER[DEMOTION_ORDER.index(load.tier) + 1 :]
    if spec.demote_tier:
        below = tuple(t for t in below if t == spec.demote_tier)
    found = []
    for tier in below:
        key = ("", tier) if tier == TierLevel.REMOTE else (load.node, tier)
        if key in tiers:
            found.append(tiers[key])
    return found


TierClaim = Callable[[Any, ManagedTier], None]
"""Called with the cursor before the planner picks victims of a tier: the recording service
serialises planners of that tier there (a dry run claims nothing)."""


def plan_movements(
    cursor: Any,
    *,
    snapshot: PolicySnapshot,
    tiers: dict[tuple[str, str], ManagedTier],
    remote_nodes: Sequence[str],
    namespaces: dict[int, str],
    reason: str,
    now: datetime,
    plan_remote: bool = True,
    limit_per_tier: int = MAX_PER_TIER,
    claim: TierClaim | None = None,
    skip: Collection[int] = (),
) -> tuple[list[PlannedMovement], list[dict[str, Any]]]:
    """The movements that bring every tier in `tiers` back under its policy, and a report of each
    tier looked at (capacity, use, watermarks in bytes). `tiers` already count what is in flight
    (`in_flight_add`) and what this plan moves already (the quota pass, whose copies are `skip`);
    the shared remote tier is a destination always and is planned itself only when `plan_remote`.
    Reads through `cursor`, writes nothing."""
    movements: list[PlannedMovement] = []
    reports: list[dict[str, Any]] = []
    # Lowest tier first: what leaves a lower tier makes room for what arrives from above.
    order = sorted(tiers.values(), key=lambda t: (-DEMOTION_ORDER.index(t.tier), t.node))
    remote_turn = 0
    for load in order:
        if load.tier == TierLevel.REMOTE and not plan_remote:
            continue
        spec = snapshot.tier(load.tier, node_group=load.group)
        capacity = spec.effective_capacity_bytes(load.capacity)
        high, low = spec.high_water_bytes(load.capacity), spec.low_water_bytes(load.capacity)
        over = load.effective_used > high
        needed = load.effective_used - low if over else 0
        reports.append(
            {
                "node": load.node,
                "tier": load.tier,
                "capacity_bytes": capacity,
                "used_bytes": load.used,
                "in_flight_bytes": load.leaving,
                "high_bytes": high,
                "low_bytes": low,
                "algorithm": spec.algorithm,
                "over_high_watermark": over,
            }
        )
        if not over and not spec.ttl_seconds:
            continue
        if claim is not None:
            claim(cursor, load)
            if over:  # another planner may have finished planning this tier while we waited
                load.leaving = leaving_bytes(cursor, load)
                needed = max(0, load.effective_used - low)
        cursor.execute(
            candidates_sql(algorithm=spec.algorithm, remote=load.tier == TierLevel.REMOTE),
            candidates_params(
                snapshot=snapshot,
                spec=spec,
                node_id=load.node_id,
                tier=load.tier,
                needed=needed,
                now=now,
                namespaces=namespaces,
                limit=limit_per_tier,
                skip=skip,
            ),
        )
        below = _next_tiers(load, tiers, spec)
        for placement_id, epoch, size, block_id, expired, below_min, held_below in cursor.fetchall():
            why = MovementReason.TTL if expired else reason

            target = None
            already = next((t.tier for t in below if t.tier in held_below), None)
            if already is not None:  # (never for remote: nothing is below it)
                load.planned_out += size
                movements.append(
                    _eviction(
                        load,
                        placement_id,
                        epoch,
                        block_id,
                        size,
                        why,
                        load.node,
                        f"a copy is already held in {already}",
                    )
                )
                continue
            if not (expired and below_min):
                target = next((t for t in below if t.room(snapshot.tier(t.tier, node_group=t.group)) >= size), None)
            if load.tier == TierLevel.REMOTE:
                exec_node = remote_nodes[remote_turn % len(remote_nodes)]
                remote_turn += 1
            else:
                exec_node = load.node
            load.planned_out += size
            if target is None:
                detail = (
                    "expired and used fewer than min_accesses times"
                    if expired and below_min
                    else "no tier below with room"
                    if below
                    else "no tier below"
                )
                movements.append(_eviction(load, placement_id, epoch, block_id, size, why, exec_node, detail))
                continue
            target.planned_in += size
            movements.append(
                PlannedMovement(
                    block_id=block_id,
                    kind=MovementKind.MOVE,
                    reason=why,
                    src_placement_id=placement_id,
                    src_epoch=epoch,
                    src_tier=load.tier,
                    src_node=load.node,
                    dst_tier=target.tier,
                    dst_node=target.node,
                    exec_node=exec_node,
                    bytes=size,
                    detail="idle past the tier's TTL"
                    if expired
                    else f"{spec.algorithm} victim over the high watermark",
                )
            )
    return movements, reports


def warm_movements(
    *, host: ManagedTier, spec: TierPolicySpec, candidates: Sequence[tuple[int, int, int, int]], reason: str
) -> list[PlannedMovement]:
    """Remote copies to bring up to `host` (a node's host tier, counting what is in flight), in
    the order of `candidates` ((placement id, epoch, size, block id)), as far as the tier has
    room below its high watermark."""
    movements = []
    for placement_id, epoch, size, block_id in candidates:
        if host.room(spec) < size:
            break
        host.planned_in += size
        movements.append(
            PlannedMovement(
                block_id=block_id,
                kind=MovementKind.WARM,
                reason=reason,
                src_placement_id=placement_id,
                src_epoch=epoch,
                src_tier=TierLevel.REMOTE,
                src_node="",
                dst_tier=TierLevel.HOST,
                dst_node=host.node,
                exec_node=host.node,
                bytes=size,
                detail="warm ahead of use",
            )
        )
    return movements
