"""Enumerations of the directory."""

from django.db import models


class Tier(models.TextChoices):
    """Storage tiers, fastest first."""

    DEVICE = "device", "L1 device (GPU memory)"
    HOST = "host", "L2 host (CPU DRAM)"
    DISK = "disk", "L2 disk (NVMe)"
    REMOTE = "remote", "L3 remote (distributed store)"


TIER_ORDER = [Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE]


class NodeState(models.TextChoices):
    UP = "up", "Up"
    STALE = "stale", "Stale (missed heartbeats)"
    DOWN = "down", "Down (shut down cleanly)"
