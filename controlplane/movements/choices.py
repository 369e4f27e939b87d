"""Enumerations of the movements ledger."""

from django.db import models

from controlplane.directory.choices import TIER_ORDER, TierLevel


class MovementKind(models.TextChoices):
    MOVE = "move", "Move (demote a copy to a slower tier)"
    EVICT = "evict", "Evict (free a copy; no tier below)"
    WARM = "warm", "Warm (promote a remote copy ahead of use)"


class MovementReason(models.TextChoices):
    WATERMARK = "watermark", "A tier went over its high watermark"
    MODE_SWITCH = "mode-switch", "A load mode was switched"
    SCHEDULE = "schedule", "A scheduled migration"
    POLICY_CHANGE = "policy-change", "A policy was edited"
    MANUAL = "manual", "An operator asked"
    TTL = "ttl", "The copy outlived its tier's TTL"
    QUOTA = "quota", "Its namespace went over its quota in the tier"


class MovementState(models.TextChoices):
    PLANNED = "planned", "Planned"
    DISPATCHED = "dispatched", "Dispatched to the node's queue"
    RUNNING = "running", "Running on the node"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled (the copy changed since it was planned)"


IN_FLIGHT = (MovementState.PLANNED, MovementState.DISPATCHED, MovementState.RUNNING)
"""States in which a movement still holds its block: at most one such movement per block."""

FINISHED = (MovementState.DONE, MovementState.FAILED, MovementState.CANCELLED)

DEMOTION_ORDER: tuple[TierLevel, ...] = tuple(t for t in TIER_ORDER if t != TierLevel.DEVICE)
"""Tiers the planner manages, fastest first. The device tier is the engine's own working set
(never registered in the directory), so it is not planned here."""

TALLY_SCRUB = "scrub"
"""Kind of the tally rows that count copies a scrub or a move found corrupt or missing."""
