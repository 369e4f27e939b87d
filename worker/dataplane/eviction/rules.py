"""What a node's eviction obeys, as plain data, and the order in which a tier's blocks leave.

The control plane sends its tier policies, priority classes and quotas as JSON (see the policies
app's `node_policies`); `parse_rules` turns them into `Rules`, checking every field before any is
used, so a bad payload is refused whole with a ValueError naming the field. `victim_order` ranks
a tier's blocks coldest first by the tier's algorithm:

* lru: least recently used first;
* lfu: fewest accesses first (the older first among equals);
* s3fifo: blocks seen once leave before blocks seen again, each group oldest-inserted first;
* cost-aware: lowest bytes x recompute cost x reuse likelihood first (a block deep in a prompt
  costs more to recompute; a block used often and lately is likely to be used again).

Whatever the algorithm, a block idle past the tier's TTL leaves before any other, and a block with
fewer accesses than `min_accesses` before any that reached it. A priority class's weight makes its
blocks look hotter (weight 2: half as idle, twice as used). Pinned blocks never leave. Among blocks
equal by the algorithm, the deepest in its prompt leaves first (a block is no use without the
blocks before it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from worker.dataplane.directory import DEFAULT_CLASS
from worker.dataplane.eviction.ledger import BlockStat
from worker.dataplane.tier_names import EVICTING_TIERS, REMOTE, TIER_ORDER

ALGORITHMS = ("lru", "lfu", "s3fifo", "cost-aware")
QUOTA_TIERS = EVICTING_TIERS
"""Tiers whose quotas a node enforces itself at write-back (remote quotas are the planner's)."""
REASONS = ("pressure", "quota", "ttl")


@dataclasses.dataclass(frozen=True)
class TierRule:
    """How blocks leave one tier of this node."""

    tier: str
    algorithm: str = "lru"
    ttl_seconds: float | None = None
    min_accesses: int = 0

    def __post_init__(self) -> None:
        if self.tier not in TIER_ORDER:
            raise ValueError(f"tier: unknown tier {self.tier!r}; expected one of {', '.join(TIER_ORDER)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm: unknown algorithm {self.algorithm!r}; expected one of {', '.join(ALGORITHMS)}"
            )
        ttl = self.ttl_seconds
        if ttl is not None and (not _is_number(ttl) or not ttl > 0):
            raise ValueError(f"ttl_seconds: a positive number of seconds or null, got {ttl!r}")
        if not isinstance(self.min_accesses, int) or isinstance(self.min_accesses, bool) or self.min_accesses < 0:
            raise ValueError(f"min_accesses: a whole number of accesses, 0 or more, got {self.min_accesses!r}")

    def is_expired(self, idle_seconds: float) -> bool:
        return self.ttl_seconds is not None and idle_seconds >= self.ttl_seconds


@dataclasses.dataclass(frozen=True)
class Rules:
    """Everything a node's eviction obeys: one rule per tier, class weights by namespace, quotas."""

    tiers: Mapping[str, TierRule] = dataclasses.field(default_factory=dict)
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Priority class weight of each namespace a class names."""
    default_weight: float = 1.0
    """Weight of namespaces no class names (the default class's)."""
    quotas: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    """(namespace, tier) -> bytes the namespace may hold in that tier of this node."""

    def tier(self, name: str) -> TierRule:
        return self.tiers.get(name) or TierRule(tier=name)

    def weight(self, namespace: str) -> float:
        return self.weights.get(namespace, self.default_weight)

    def quota(self, namespace: str, tier: str) -> int | None:
        return self.quotas.get((namespace, tier))


def parse_rules(
    *,
    tiers: Sequence[Mapping[str, Any]] = (),
    classes: Sequence[Mapping[str, Any]] = (),
    quotas: Sequence[Mapping[str, Any]] = (),
    node_group: str = "",
) -> Rules:
    """Rules from the control plane's JSON. A tier policy of the node's group wins over the
    fleet-wide one; policies of other groups are ignored. Raises ValueError naming the field
    (e.g. `tiers[1].algorithm`) at the first bad one."""
    chosen: dict[str, tuple[bool, TierRule]] = {}
    for i, item in enumerate(_objects(tiers, "tiers")):
        group = _field(item, "node_group", f"tiers[{i}]", str, "")
        try:
            rule = TierRule(
                tier=_field(item, "tier", f"tiers[{i}]", str, ""),
                algorithm=_field(item, "algorithm", f"tiers[{i}]", str, "lru"),
                ttl_seconds=item.get("ttl_seconds"),
                min_accesses=item.get("min_accesses", 0),
            )
        except ValueError as exc:
            raise ValueError(f"tiers[{i}].{exc}") from None
        if group and group != node_group:
            continue
        specific = bool(group)
        held = chosen.get(rule.tier)
        if held is None or specific or not held[0]:
            chosen[rule.tier] = (specific, rule)
    weights: dict[str, float] = {}
    default_weight = 1.0
    for i, item in enumerate(_objects(classes, "classes")):
        name = _field(item, "name", f"classes[{i}]", str, "")
        weight = item.get("weight", 1.0)
        if not _is_number(weight) or not weight > 0:
            raise ValueError(f"classes[{i}].weight: class {name!r} needs a positive weight, got {weight!r}")
        namespaces = item.get("namespaces", ())
        if isinstance(namespaces, str) or not isinstance(namespaces, (list, tuple)):
            raise ValueError(f"classes[{i}].namespaces: class {name!r} needs a list of namespace names")
        for namespace in namespaces:
            weights[str(namespace)] = float(weight)
        if name == DEFAULT_CLASS:
            default_weight = float(weight)
    limits: dict[tuple[str, str], int] = {}
    for i, item in enumerate(_objects(quotas, "quotas")):
        namespace = _field(item, "namespace", f"quotas[{i}]", str, "")
        if not namespace:
            raise ValueError(f"quotas[{i}].namespace: a quota needs a namespace")
        tier = _field(item, "tier", f"quotas[{i}]", str, "")
        if tier not in (*QUOTA_TIERS, REMOTE):
            raise ValueError(f"quotas[{i}].tier: a quota is for host, disk or remote, got {tier!r}")
        nbytes = item.get("bytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"quotas[{i}].bytes: a whole number of bytes, 0 or more, got {nbytes!r}")
        if tier in QUOTA_TIERS:
            limits[(namespace, tier)] = nbytes
    return Rules(
        tiers={name: rule for name, (_, rule) in chosen.items()},
        weights=weights,
        default_weight=default_weight,
        quotas=limits,
    )


def victim_order(
    blocks: Iterable[BlockStat], rule: TierRule, *, now: float, weight: Mapping[str, float] | Rules | None = None
) -> list[BlockStat]:
    """`blocks` coldest first by `rule` (pinned blocks left out): expired ones, then those under
    `min_accesses`, then the rest by the tier's algorithm."""
    rules = weight if isinstance(weight, Rules) else Rules(weights=dict(weight or {}))

    def rank(stat: BlockStat) -> tuple[int, int, float, float, int]:
        w = rules.weight(stat.namespace)
        idle = max(0.0, now - stat.last_access)
        expired = 0 if rule.is_expired(idle) else 1
        under = 0 if stat.accesses < rule.min_accesses else 1
        if rule.algorithm == "lfu":
            return (expired, under, stat.accesses * w, -idle / w, -stat.position)
        if rule.algorithm == "s3fifo":
            seen_again = 1 if stat.accesses > 1 else 0
            return (expired, under, seen_again, -max(0.0, now - stat.inserted) / w, -stat.position)
        if rule.algorithm == "cost-aware":
            return (expired, under, cost_value(stat, now=now, weight=w), -idle, -stat.position)
        return (expired, under, -idle / w, 0.0, -stat.position)

    return sorted((stat for stat in blocks if not stat.pinned), key=rank)


def cost_value(stat: BlockStat, *, now: float, weight: float = 1.0) -> float:
    """What keeping a block is worth: recompute cost (tokens up to and including the block: the
    attention over its prefix) x reuse likelihood (accesses per idle second) x class weight, per
    byte it occupies (bytes are the price)."""
    idle = max(0.0, now - stat.last_access)
    reuse = stat.accesses / (1.0 + idle)
    recompute = float(stat.position + stat.tokens)
    return weight * reuse * recompute / max(1, stat.nbytes)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _objects(items: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, (list, tuple)):
        raise ValueError(f"{name}: a list of objects, got {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"{name}[{i}]: an object, got {type(item).__name__}")
    return list(items)


def _field(item: Mapping[str, Any], key: str, where: str, kind: type, default: Any) -> Any:
    value = item.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, kind):
        raise ValueError(f"{where}.{key}: a {kind.__name__}, got {value!r}")
    return value
