"""Which blocks leave first, per algorithm, and the policy payload a node refuses (pure data)."""

from __future__ import annotations

import re
import uuid

import pytest

from worker.dataplane.eviction.ledger import BlockStat
from worker.dataplane.eviction.rules import Rules, TierRule, parse_rules, victim_order


def stat(name: str, *, last: float, accesses: int = 1, inserted: float | None = None, **extra: object) -> BlockStat:
    return BlockStat(
        key=uuid.uuid5(uuid.NAMESPACE_OID, name),
        namespace=str(extra.pop("namespace", "a")),
        nbytes=int(extra.pop("nbytes", 1000)),  # type: ignore[call-overload]
        inserted=last if inserted is None else inserted,
        last_access=last,
        accesses=accesses,
        position=int(extra.pop("position", 0)),  # type: ignore[call-overload]
        tokens=16,
        pinned=bool(extra.pop("pinned", False)),
    )


def names(order: list[BlockStat], blocks: dict[str, BlockStat]) -> list[str]:
    by_key = {b.key: name for name, b in blocks.items()}
    return [by_key[s.key] for s in order]


def rank(blocks: dict[str, BlockStat], rule: TierRule, *, now: float = 100.0, rules: Rules | None = None) -> list[str]:
    return names(victim_order(blocks.values(), rule, now=now, weight=rules), blocks)


def test_lru_evicts_the_least_recently_used_first():
    blocks = {"old": stat("old", last=10), "new": stat("new", last=90), "mid": stat("mid", last=50)}
    assert rank(blocks, TierRule("host")) == ["old", "mid", "new"]


def test_lfu_evicts_the_least_often_used_first_older_first_among_equals():
    blocks = {
        "often": stat("often", last=10, accesses=9),
        "once-old": stat("once-old", last=20),
        "once-new": stat("once-new", last=80),
        "twice": stat("twice", last=90, accesses=2),
    }
    assert rank(blocks, TierRule("host", algorithm="lfu")) == ["once-old", "once-new", "twice", "often"]


def test_s3fifo_evicts_blocks_seen_once_before_blocks_seen_again_each_in_insertion_order():
    blocks = {
        "again-first": stat("again-first", last=95, inserted=5, accesses=3),
        "once-late": stat("once-late", last=70, inserted=70),
        "once-early": stat("once-early", last=30, inserted=30),
        "again-late": stat("again-late", last=60, inserted=40, accesses=2),
    }
    assert rank(blocks, TierRule("host", algorithm="s3fifo")) == [
        "once-early",
        "once-late",
        "again-first",
        "again-late",
    ]


def test_cost_aware_keeps_deep_often_used_blocks_and_drops_cheap_idle_ones():
    blocks = {
        "deep-hot": stat("deep-hot", last=95, accesses=5, position=4096),
        "shallow-hot": stat("shallow-hot", last=95, accesses=5, position=512),
        "deep-idle": stat("deep-idle", last=0, accesses=1, position=4096),
        "big-hot": stat("big-hot", last=95, accesses=5, position=4096, nbytes=100_000),
    }
    # deep-idle: little reuse; big-hot: same worth as deep-hot, 100x the bytes.
    assert set(rank(blocks, TierRule("host", algorithm="cost-aware"))[:2]) == {"deep-idle", "big-hot"}
    assert rank(blocks, TierRule("host", algorithm="cost-aware"))[-1] == "deep-hot"


@pytest.mark.parametrize("algorithm", ["lru", "lfu", "s3fifo", "cost-aware"])
def test_pinned_blocks_never_leave_and_expired_ones_leave_first(algorithm):
    blocks = {
        "pinned-cold": stat("pinned-cold", last=0, accesses=1, pinned=True),
        "hot": stat("hot", last=99, accesses=50),
        "expired": stat("expired", last=1, accesses=100, inserted=0),
        "warm": stat("warm", last=80, accesses=2),
    }
    order = rank(blocks, TierRule("host", algorithm=algorithm, ttl_seconds=60))
    assert "pinned-cold" not in order and order[0] == "expired" and len(order) == 3


@pytest.mark.parametrize("algorithm", ["lru", "lfu", "s3fifo", "cost-aware"])
def test_blocks_under_min_accesses_leave_before_any_that_reached_it(algorithm):
    blocks = {
        "used-3-old": stat("used-3-old", last=1, inserted=0, accesses=3),
        "used-1-new": stat("used-1-new", last=99, inserted=99, accesses=1, position=8192),
        "used-2-new": stat("used-2-new", last=98, inserted=98, accesses=2, position=8192),
    }
    order = rank(blocks, TierRule("host", algorithm=algorithm, min_accesses=3))
    assert order[-1] == "used-3-old" and set(order[:2]) == {"used-1-new", "used-2-new"}


def test_a_class_weight_makes_its_blocks_look_hotter():
    blocks = {"gold": stat("gold", last=40, namespace="vip"), "plain": stat("plain", last=60, namespace="bulk")}
    assert rank(blocks, TierRule("host")) == ["gold", "plain"]
    heavy = Rules(weights={"vip": 4.0})  # idle 60 s / 4 = 15 s < 40 s
    assert rank(blocks, TierRule("host"), rules=heavy) == ["plain", "gold"]
    lfu = {"gold": stat("gold", last=40, accesses=2, namespace="vip"), "plain": stat("plain", last=40, accesses=5)}
    assert rank(lfu, TierRule("host", algorithm="lfu"), rules=heavy) == ["plain", "gold"]


def test_among_equals_the_deepest_block_leaves_first():
    blocks = {f"p{i}": stat(f"p{i}", last=50, position=16 * i) for i in range(3)}
    assert rank(blocks, TierRule("host")) == ["p2", "p1", "p0"]


PAYLOAD = {
    "tiers": [
        {"tier": "host", "algorithm": "lfu", "ttl_seconds": 600, "min_accesses": 2, "high_watermark": 0.9},
        {"tier": "host", "node_group": "big", "algorithm": "s3fifo"},
        {"tier": "device", "algorithm": "cost-aware"},
    ],
    "classes": [
        {"name": "default", "weight": 1.5, "device_share": 1.0, "namespaces": []},
        {"name": "gold", "weight": 3, "device_share": 0.5, "namespaces": ["vip"]},
    ],
    "quotas": [
        {"namespace": "bulk", "tier": "host", "bytes": 4096},
        {"namespace": "bulk", "tier": "remote", "bytes": 1},
    ],
}


def test_the_policy_payload_parses_with_the_node_groups_own_policy_winning():
    fleet = parse_rules(**PAYLOAD)
    assert fleet.tier("host") == TierRule("host", algorithm="lfu", ttl_seconds=600, min_accesses=2)
    assert fleet.tier("device").algorithm == "cost-aware" and fleet.tier("disk") == TierRule("disk")
    assert fleet.weight("vip") == 3 and fleet.weight("other") == 1.5
    assert fleet.quota("bulk", "host") == 4096 and fleet.quota("bulk", "remote") is None
    assert parse_rules(**PAYLOAD, node_group="big").tier("host").algorithm == "s3fifo"


@pytest.mark.parametrize(
    ("part", "index", "change", "field"),
    [
        ("tiers", 0, {"algorithm": "mru"}, "tiers[0].algorithm"),
        ("tiers", 1, {"tier": "tape"}, "tiers[1].tier"),
        ("tiers", 0, {"ttl_seconds": -5}, "tiers[0].ttl_seconds"),
        ("tiers", 2, {"min_accesses": 1.5}, "tiers[2].min_accesses"),
        ("tiers", 0, {"node_group": 7}, "tiers[0].node_group"),
        ("classes", 1, {"weight": 0}, "classes[1].weight"),
        ("classes", 1, {"namespaces": "vip"}, "classes[1].namespaces"),
        ("quotas", 0, {"bytes": -1}, "quotas[0].bytes"),
        ("quotas", 0, {"tier": "device"}, "quotas[0].tier"),
        ("quotas", 1, {"namespace": ""}, "quotas[1].namespace"),
    ],
)
def test_a_bad_field_is_refused_by_name(part, index, change, field):
    payload = {key: [dict(item) for item in items] for key, items in PAYLOAD.items()}
    payload[part][index].update(change)
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        parse_rules(**payload)


def test_a_payload_that_is_not_a_list_of_objects_is_refused():
    with pytest.raises(ValueError, match=r"^tiers: a list"):
        parse_rules(tiers={"tier": "host"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^quotas\[0\]: an object"):
        parse_rules(quotas=["host"])  # type: ignore[list-item]
