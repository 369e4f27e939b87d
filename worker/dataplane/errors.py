"""Typed errors of the data plane: what a tier or the store refuses, and why."""

from __future__ import annotations

import uuid


class DataplaneError(Exception):
    """Base of every error the data plane raises on purpose."""


class TierFull(DataplaneError):
    """A write was refused because the tier has no room; nothing partial was left behind."""

    def __init__(self, tier: str, *, needed: int, free: int | None = None, detail: str = "") -> None:
        self.tier = tier
        self.needed = needed
        self.free = free
        free_text = "" if free is None else f", {free} free"
        super().__init__(f"tier {tier} is full: {needed} bytes needed{free_text}{'; ' + detail if detail else ''}")


class BlockMissing(DataplaneError):
    """The block is not stored in the tier (or in any tier the store asked)."""

    def __init__(self, key: uuid.UUID, *, tier: str | None = None, causes: tuple[Exception, ...] = ()) -> None:
        self.key = key
        self.tier = tier
        self.causes = causes
        where = f"tier {tier}" if tier else "any tier"
        super().__init__(f"block {key} is not in {where}")


class BlockCorrupt(DataplaneError):
    """Stored bytes failed verification (checksum, size, key or layout); they were not served.

    Callers treat this as a miss: the tier has already removed the bad copy and counted it."""

    def __init__(self, key: uuid.UUID, *, tier: str, reason: str) -> None:
        self.key = key
        self.tier = tier
        self.reason = reason
        super().__init__(f"block {key} in tier {tier} is corrupt: {reason}")


class BlockUnregistered(BlockCorrupt):
    """A copy in the shared remote tier whose checksum is not the one the directory registered
    for its key: bytes written under the key by someone who did not register them (every node
    can write to L3, so a self-consistent value proves nothing by itself). Never served: the read
    is a miss. Unlike other corrupt copies the tier keeps it until the failed load is quarantined,
    which drops it (if it still holds those bytes) and marks its placement corrupt."""

    def __init__(self, key: uuid.UUID, *, tier: str, stored: str, registered: str) -> None:
        self.stored = stored
        self.registered = registered
        super().__init__(
            key,
            tier=tier,
            reason=f"its checksum {stored or '(none)'} is not the one registered for the block, {registered}",
        )


class TierUnavailable(DataplaneError):
    """The tier's medium cannot be reached right now (e.g. Redis down); callers recompute."""

    def __init__(self, tier: str, *, reason: str) -> None:
        self.tier = tier
        self.reason = reason
        super().__init__(f"tier {tier} is unavailable: {reason}")


MISSES: tuple[type[DataplaneError], ...] = (BlockMissing, BlockCorrupt, TierUnavailable)
"""Errors a reader treats as a miss: try the next tier or recompute."""
