"""The policies as plain frozen data: the specs the planner, the dry-run and the nodes read.

Contract between the policies app (which stores, versions and validates them) and the movements
planner (which only reads them). `snapshot.policies_snapshot()` reads the ones in force.
"""

from __future__ import annotations

import dataclasses

from controlplane.directory.choices import DEFAULT_CLASS, TierLevel

ALGORITHMS = ("lru", "lfu", "s3fifo", "cost-aware")

REMOTE_WRITES = ("on-demotion", "write-through")
"""When a class's blocks reach the shared remote tier (L3): only when the planner demotes them
(on-demotion), or at write-back, beside the node's own copy (write-through), so that every node
of the fleet finds them at once."""

QUOTA_TIERS: tuple[str, ...] = (TierLevel.HOST.value, TierLevel.DISK.value, TierLevel.REMOTE.value)
"""Tiers a namespace's bytes can be capped in (host and disk per node; remote for the fleet)."""


@dataclasses.dataclass(frozen=True)
class PriorityClassSpec:
    name: str
    weight: float = 1.0
    device_share: float = 1.0
    """Largest fraction (0..1) of a node's device tier that blocks of this class may hold."""
    namespaces: tuple[str, ...] = ()
    remote_write: str = "on-demotion"
    """One of REMOTE_WRITES: whether write-back also copies the class's blocks to L3 at once."""


@dataclasses.dataclass(frozen=True)
class QuotaSpec:
    """At most `bytes` of one namespace's blocks in one tier: in each node's host or disk tier,
    or in the shared remote tier. A write-back over it evicts the namespace's own coldest blocks
    first, and so does the planner."""

    namespace: str
    tier: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TierPolicySpec:
    tier: str
    node_group: str = ""
    """Empty: every node; otherwise nodes whose `group` is this name (the more specific wins)."""
    capacity_bytes: int | None = None
    """None: the capacity the node reports; otherwise a cap (never more than the node reports)."""
    high_watermark: float = 0.90
    """Above high_watermark × effective capacity the planner moves blocks out of the tier..."""
    low_watermark: float = 0.75
    """...until the tier is down to low_watermark × effective capacity."""
    algorithm: str = "lru"
    """Which blocks leave first: lru (least recently used), lfu (least often used), s3fifo (blocks
    seen once leave before blocks seen again), cost-aware (lowest bytes × recompute cost × reuse
    likelihood first)."""
    ttl_seconds: int | None = None
    """A block idle this long in the tier is cold: it leaves even below the high watermark.
    None: only watermark pressure makes blocks leave."""
    min_accesses: int = 0
    """Blocks with fewer accesses than this leave before any block that has reached it (0: no
    block is set apart)."""
    capacity_fraction: float = 1.0
    """Share (0..1] of the capacity (capacity_bytes, or the node's report) the cache may fill; the
    rest is headroom (for the host tier: room for write-backs from the device tier). A mode that
    raises it gives the planner a larger effective capacity, e.g. long-doc grows the host tier."""
    demote_tier: str = ""
    """Where blocks leaving this tier go: a slower tier, or "" for the next slower tier the node
    has (a block leaving the last tier is evicted)."""

    def effective_capacity_bytes(self, reported_bytes: int) -> int:
        """Bytes of the tier the cache may fill on a node that reports `reported_bytes`."""
        cap = reported_bytes if self.capacity_bytes is None else min(self.capacity_bytes, reported_bytes)
        return int(cap * self.capacity_fraction)

    def high_water_bytes(self, reported_bytes: int) -> int:
        """Use above which the planner starts moving blocks out of the tier."""
        return int(self.effective_capacity_bytes(reported_bytes) * self.high_watermark)

    def low_water_bytes(self, reported_bytes: int) -> int:
        """Use the planner brings the tier down to once it passed the high watermark."""
        return int(self.effective_capacity_bytes(reported_bytes) * self.low_watermark)

    def is_expired(self, idle_seconds: float) -> bool:
        """Whether a block idle for `idle_seconds` is past the tier's TTL."""
        return self.ttl_seconds is not None and idle_seconds >= self.ttl_seconds


@dataclasses.dataclass(frozen=True)
class PolicySnapshot:
    version: int
    """Global policy version (grows with every edit, switch or rollback); recorded on each movement."""
    mode: str
    """Name of the mode in force ("" when none)."""
    classes: tuple[PriorityClassSpec, ...]
    tiers: tuple[TierPolicySpec, ...]
    quotas: tuple[QuotaSpec, ...] = ()

    def quota(self, namespace: str, tier: str) -> int | None:
        """Bytes `namespace` may hold in `tier` (per node for host and disk), None when unlimited."""
        for spec in self.quotas:
            if spec.namespace == namespace and spec.tier == tier:
                return spec.bytes
        return None

    def tier(self, tier: str, *, node_group: str = "") -> TierPolicySpec:
        """The policy for `tier` on nodes of `node_group`: the group's own, else the fleet-wide
        one, else the built-in default."""
        fleet = None
        for spec in self.tiers:
            if spec.tier == tier and spec.node_group == node_group and node_group:
                return spec
            if spec.tier == tier and not spec.node_group:
                fleet = spec
        return fleet or TierPolicySpec(tier=tier)

    def class_of_namespace(self, namespace: str) -> PriorityClassSpec:
        for spec in self.classes:
            if namespace in spec.namespaces:
                return spec
        for spec in self.classes:
            if spec.name == DEFAULT_CLASS:
                return spec
        return PriorityClassSpec(name=DEFAULT_CLASS)
