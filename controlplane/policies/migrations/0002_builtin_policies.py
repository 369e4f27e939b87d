"""Seed the built-in policies and modes, and record them as policy version 1.

- classes: `default` (every namespace no other class names) and `batch` (low priority); their
  device shares add up to 100%;
- fleet-wide tier policies: evict by access frequency (lfu); the host tier normally fills half of
  the DRAM pool the node reports, keeping the rest as headroom for write-backs;
- modes: `chat-peak` caps the batch class at 10% of the device tier and drains the device tier
  further; `long-doc` lets the host tier fill the whole pool up to 98%; `nightly-batch` sends host
  blocks idle for 15 minutes (or under pressure, rarely used ones first) to the remote tier.
"""

from django.db import migrations

CLASSES = [
    {"name": "batch", "weight": 0.2, "device_share": 0.3, "namespaces": []},
    {"name": "default", "weight": 1.0, "device_share": 0.7, "namespaces": []},
]

_TIER_DEFAULTS = {
    "node_group": "",
    "capacity_bytes": None,
    "capacity_fraction": 1.0,
    "high_watermark": 0.9,
    "low_watermark": 0.75,
    "algorithm": "lfu",
    "ttl_seconds": None,
    "min_accesses": 0,
    "demote_tier": "",
}
TIERS = [
    {**_TIER_DEFAULTS, "tier": "device"},
    {**_TIER_DEFAULTS, "tier": "host", "capacity_fraction": 0.5},
    {**_TIER_DEFAULTS, "tier": "disk"},
    {**_TIER_DEFAULTS, "tier": "remote", "high_watermark": 0.95, "low_watermark": 0.85},
]

MODES = [
    {
        "name": "chat-peak",
        "kind": "chat-peak",
        "description": "Protect the device tier for realtime chat: batch blocks may hold at most 10% of it.",
        "overrides": {
            "tiers": [{"tier": "device", "node_group": "", "low_watermark": 0.6}],
            "classes": [{"name": "batch", "device_share": 0.1}, {"name": "default", "device_share": 0.9}],
        },
    },
    {
        "name": "long-doc",
        "kind": "long-doc",
        "description": "Long documents: the host tier may fill the whole DRAM pool, up to 98%.",
        "overrides": {
            "tiers": [
                {
                    "tier": "host",
                    "node_group": "",
                    "capacity_bytes": None,
                    "capacity_fraction": 1.0,
                    "high_watermark": 0.98,
                    "low_watermark": 0.9,
                }
            ],
            "classes": [],
        },
    },
    {
        "name": "nightly-batch",
        "kind": "nightly-batch",
        "description": "Nightly batch: host blocks idle for 15 minutes move to the remote tier to free room.",
        # min_accesses stays 0: an expired block used fewer times than that is evicted, not moved,
        # and the night's job is to keep every block, only further away.
        "overrides": {
            "tiers": [
                {
                    "tier": "host",
                    "node_group": "",
                    "high_watermark": 0.6,
                    "low_watermark": 0.3,
                    "ttl_seconds": 900,
                    "min_accesses": 0,
                    "demote_tier": "remote",
                }
            ],
            "classes": [],
        },
    },
]


def seed(apps, schema_editor):
    get = apps.get_model
    for values in CLASSES:
        get("policies", "PriorityClass").objects.update_or_create(name=values["name"], defaults=values)
    for values in TIERS:
        get("policies", "TierPolicy").objects.update_or_create(tier=values["tier"], node_group="", defaults=values)
    for values in MODES:
        get("policies", "Mode").objects.update_or_create(name=values["name"], defaults=values)
    get("policies", "PolicyVersion").objects.create(
        number=1,
        action="policy.seed",
        author="",
        comment="built-in classes, tier policies and modes",
        snapshot={"classes": CLASSES, "tiers": TIERS, "modes": MODES, "active_mode": ""},
    )


def unseed(apps, schema_editor):
    for model in ("PolicyVersion", "Mode", "TierPolicy", "PriorityClass"):
        apps.get_model("policies", model).objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [("policies", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
