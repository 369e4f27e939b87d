"""Enumerations of the policies app."""

from django.db import models


class Algorithm(models.TextChoices):
    """Eviction orders a tier policy can choose (which blocks leave a tier first)."""

    LRU = "lru", "Least recently used"
    LFU = "lfu", "Least frequently used"
    S3FIFO = "s3fifo", "S3-FIFO (blocks seen once leave first)"
    COST_AWARE = "cost-aware", "Cost-aware (bytes × recompute cost × reuse likelihood)"


class QuotaTier(models.TextChoices):
    """Tiers a namespace quota can cap (specs.QUOTA_TIERS): host and disk per node, remote fleet-wide."""

    HOST = "host", "L2 host (per node)"
    DISK = "disk", "L2 disk (per node)"
    REMOTE = "remote", "L3 remote (the fleet)"


class RemoteWrite(models.TextChoices):
    """When a class's blocks reach the shared remote tier (specs.REMOTE_WRITES)."""

    ON_DEMOTION = "on-demotion", "On demotion (the planner moves them there)"
    WRITE_THROUGH = "write-through", "Write-through (at write-back, beside the node's copy)"


class ModeKind(models.TextChoices):
    """What a mode is for; the three built-in load situations and the operator's own."""

    CHAT_PEAK = "chat-peak", "Chat peak (protect the device tier for realtime traffic)"
    LONG_DOC = "long-doc", "Long-document peak (grow the host tier)"
    NIGHTLY_BATCH = "nightly-batch", "Nightly batch (move cold host blocks to remote)"
    CUSTOM = "custom", "Custom"


MODE_SWITCH_TASK = "policies.mode_switch"
"""Celery task name a mode schedule's beat entry runs."""

LOAD_FOLLOW_TASK = "policies.load_follow"
"""Celery task name of the load-following check (a beat entry every 60 s, migration 0004)."""
