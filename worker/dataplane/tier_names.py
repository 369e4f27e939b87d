"""The tiers' names: the one spelling of each storage level, and their order, fastest first.

Every layer names tiers by these codes: node options, the directory's rows, movements, metrics
and the vLLM connector's KV events. Code outside `tiers/` names a tier through these constants;
the control plane's `TierLevel` choices carry the same values. A module of its own, importing
nothing, so that the control plane reads it without the tiers' code.
"""

from __future__ import annotations

DEVICE = "device"
"""L1: GPU memory (CPU memory where there is no GPU), a pool of pages."""
HOST = "host"
"""L2: the node's shared-memory DRAM pool."""
DISK = "disk"
"""L2: one file per block on local NVMe (or a shared mount)."""
REMOTE = "remote"
"""L3: Redis/Valkey, the one tier shared by every node: its placements belong to no node."""

TIER_ORDER: tuple[str, ...] = (DEVICE, HOST, DISK, REMOTE)
"""Tier codes, fastest first: a lookup prefers the earliest tier holding a READY copy."""

EVICTING_TIERS: tuple[str, ...] = (HOST, DISK)
"""The node's tiers below L1 that evict by policy when full (quotas and eviction rules apply)."""
