"""Enumerations of the directory, and the control plane's one definition of the tier order, the
batch limit and the default class."""

from django.db import models

from worker.dataplane import directory as protocol
from worker.dataplane import tier_names


class TierLevel(models.TextChoices):
    """Storage tier levels, fastest first: the data plane's tier names (`tier_names`)."""

    DEVICE = tier_names.DEVICE, "L1 device (GPU memory)"
    HOST = tier_names.HOST, "L2 host (CPU DRAM)"
    DISK = tier_names.DISK, "L2 disk (NVMe)"
    REMOTE = tier_names.REMOTE, "L3 remote (distributed store)"


TIER_ORDER: tuple[TierLevel, ...] = tuple(TierLevel(name) for name in tier_names.TIER_ORDER)
"""Tier levels, fastest first: the data plane's order, every one a TierLevel."""


class NodeState(models.TextChoices):
    UP = "up", "Up"
    STALE = "stale", "Stale (missed heartbeats)"
    DOWN = "down", "Down (shut down cleanly)"


class PlacementState(models.TextChoices):
    """Lifecycle of one copy of a block in one tier: only READY copies are ever served."""

    PENDING = "pending", "Pending (bytes being written)"
    READY = "ready", "Ready (bytes verified, servable)"
    CORRUPT = "corrupt", "Corrupt (failed verification, quarantined)"
    DELETING = "deleting", "Deleting (bytes being freed)"


class Dtype(models.TextChoices):
    """KV dtypes the data plane stores (worker.dataplane.profile.KV_DTYPES)."""

    FLOAT32 = "float32", "float32"
    FLOAT16 = "float16", "float16"
    BFLOAT16 = "bfloat16", "bfloat16"


class BlockOrdering(models.TextChoices):
    """Orderings of the block list; each maps to a unique column tuple so cursors are stable."""

    NEWEST = "-created_at", "Newest first"
    OLDEST = "created_at", "Oldest first"
    HOTTEST = "-access_count", "Most accessed first"
    COLDEST = "access_count", "Least accessed first"
    RECENT = "-last_access_at", "Most recently accessed first"
    IDLE = "last_access_at", "Least recently accessed first"


# Creation order is id order (ids come from one sequence at insert), so age needs no index of its own.
BLOCK_ORDERING_COLUMNS: dict[str, tuple[str, ...]] = {
    BlockOrdering.NEWEST: ("-id",),
    BlockOrdering.OLDEST: ("id",),
    BlockOrdering.HOTTEST: ("-access_count", "-id"),
    BlockOrdering.COLDEST: ("access_count", "id"),
    BlockOrdering.RECENT: ("-last_access_at", "-id"),
    BlockOrdering.IDLE: ("last_access_at", "id"),
}

DEFAULT_CLASS = protocol.DEFAULT_CLASS
"""Priority class of a block until the policies app says otherwise; the class that holds every
namespace no other class names."""

MAX_BATCH = protocol.MAX_BATCH
"""Most keys (or blocks) one lookup or registration may carry."""
