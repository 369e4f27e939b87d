"""The policy rules and the overrides merge, without a database: every rule names its field, and a
mode's partial overrides land on the policy they key."""

from __future__ import annotations

import pytest

from controlplane.policies import rules
from controlplane.policies.choices import Algorithm
from controlplane.policies.errors import PolicyError
from controlplane.policies.snapshot import (
    ALGORITHMS,
    PolicySnapshot,
    PriorityClassSpec,
    TierPolicySpec,
)

CLASSES = (
    PriorityClassSpec(name="batch", weight=0.2, device_share=0.3, namespaces=("jobs",)),
    PriorityClassSpec(name="default", weight=1.0, device_share=0.7),
)
TIERS = (TierPolicySpec(tier="device"), TierPolicySpec(tier="host", capacity_fraction=0.5))


def _field(call) -> str:
    with pytest.raises(PolicyError) as info:
        call()
    assert str(info.value).startswith(info.value.field), info.value
    return info.value.field


def test_choices_and_contract_name_the_same_algorithms():
    assert tuple(Algorithm.values) == ALGORITHMS


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"capacity_bytes": 2**63}, "capacity_bytes"),
        ({"capacity_bytes": "lots"}, "capacity_bytes"),
        ({"algorithm": "random"}, "algorithm"),
        ({"high_watermark": 0}, "high_watermark"),
        ({"high_watermark": 1.2}, "high_watermark"),
        ({"low_watermark": float("nan")}, "low_watermark"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"min_accesses": -3}, "min_accesses"),
        ({"capacity_fraction": 0}, "capacity_fraction"),
        ({"tier": "tape"}, "tier"),
        ({"node_group": "no spaces"}, "node_group"),
        ({"demote_tier": "tape"}, "demote_tier"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_tier_field_rules_name_the_field(data, field):
    assert _field(lambda: rules.fields_check(data, rules.TIER_RULES)) == field


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": True}, "weight"),
        ({"device_share": 1.5}, "device_share"),
        ({"device_share": -0.1}, "device_share"),
        ({"name": "has space"}, "name"),
        ({"namespaces": "tenant-a"}, "namespaces"),
        ({"namespaces": ["ok", "not ok"]}, "namespaces[1]"),
        ({"namespaces": ["a", "a"]}, "namespaces"),
    ],
)
def test_class_field_rules_name_the_field(data, field):
    assert _field(lambda: rules.fields_check(data, rules.CLASS_RULES)) == field


def test_values_are_normalised():
    clean = rules.fields_check({"capacity_bytes": 10.0, "high_watermark": 1, "ttl_seconds": None}, rules.TIER_RULES)
    assert clean == {"capacity_bytes": 10, "high_watermark": 1.0, "ttl_seconds": None}
    assert rules.fields_check({"namespaces": ["b", "a"]}, rules.CLASS_RULES) == {"namespaces": ("a", "b")}


def test_watermarks_must_be_ordered_and_demotion_goes_down():
    assert (
        _field(lambda: rules.tier_check(TierPolicySpec(tier="host", high_watermark=0.8, low_watermark=0.8)))
        == "low_watermark"
    )
    assert _field(lambda: rules.tier_check(TierPolicySpec(tier="disk", demote_tier="host"))) == "demote_tier"
    rules.tier_check(TierPolicySpec(tier="host", demote_tier="remote"))


def test_shares_over_100_percent_and_shared_namespaces_are_refused():
    over = (*CLASSES, PriorityClassSpec(name="extra", device_share=0.05))
    assert _field(lambda: rules.classes_check(over)) == "device_share"
    twice = (*CLASSES, PriorityClassSpec(name="other", device_share=0.0, namespaces=("jobs",)))
    assert _field(lambda: rules.classes_check(twice)) == "namespaces"
    # Float sums a hair over 1 are exactly 100%.
    rules.classes_check(
        (
            PriorityClassSpec(name="a", device_share=0.7),
            PriorityClassSpec(name="b", device_share=0.2),
            PriorityClassSpec(name="c", device_share=0.1),
        )
    )


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([], "overrides"),
        ({"tiers": {}}, "overrides.tiers"),
        ({"extras": []}, "overrides.extras"),
        ({"tiers": [{"high_watermark": 0.5}]}, "overrides.tiers[0].tier"),
        ({"tiers": [{"tier": "host"}, {"tier": "host", "node_group": ""}]}, "overrides.tiers[1].tier"),
        ({"tiers": [{"tier": "host", "algorithm": "fifo"}]}, "overrides.tiers[0].algorithm"),
        ({"tiers": [{"tier": "host", "capacity_bytes": -5}]}, "overrides.tiers[0].capacity_bytes"),
        ({"classes": [{"device_share": 0.1}]}, "overrides.classes[0].name"),
        ({"classes": [{"name": "batch", "weight": -1}]}, "overrides.classes[0].weight"),
    ],
)
def test_overrides_shape_and_fields_are_checked(raw, field):
    assert _field(lambda: rules.overrides_parse(raw)) == field


def test_overrides_merge_onto_the_keyed_policies():
    overrides = rules.overrides_parse(
        {
            "tiers": [
                {"tier": "host", "high_watermark": 0.98, "low_watermark": 0.9, "capacity_fraction": 1.0},
                {"tier": "disk", "node_group": "big", "ttl_seconds": 60},
            ],
            "classes": [{"name": "batch", "device_share": 0.1}, {"name": "urgent", "device_share": 0.1}],
        }
    )
    classes, tiers = rules.overrides_apply(CLASSES, TIERS, overrides)
    snap = PolicySnapshot(version=1, mode="m", classes=classes, tiers=tiers)
    assert snap.tier("host").high_watermark == 0.98 and snap.tier("host").capacity_fraction == 1.0
    assert snap.tier("device") == TIERS[0]
    # A group without its own policy starts from the fleet-wide one for that tier (here the default).
    assert snap.tier("disk", node_group="big") == TierPolicySpec(tier="disk", node_group="big", ttl_seconds=60)
    assert snap.tier("disk", node_group="small") == TierPolicySpec(tier="disk")
    assert snap.class_of_namespace("jobs").device_share == 0.1
    assert [c.name for c in classes] == ["batch", "default", "urgent"]
    # The inputs are left alone.
    assert CLASSES[0].device_share == 0.3


def test_merged_result_errors_name_the_override_entry():
    bad_order = rules.overrides_parse({"tiers": [{"tier": "device"}, {"tier": "host", "low_watermark": 0.95}]})
    assert _field(lambda: rules.overrides_apply(CLASSES, TIERS, bad_order)) == "overrides.tiers[1].low_watermark"
    over = rules.overrides_parse(
        {"classes": [{"name": "default", "weight": 2}, {"name": "batch", "device_share": 0.5}]}
    )
    assert _field(lambda: rules.overrides_apply(CLASSES, TIERS, over)) == "overrides.classes[1].device_share"


def test_effective_capacity_and_ttl_helpers():
    spec = TierPolicySpec(
        tier="host", capacity_bytes=600, capacity_fraction=0.5, high_watermark=0.9, low_watermark=0.5, ttl_seconds=100
    )
    assert spec.effective_capacity_bytes(1000) == 300
    assert spec.effective_capacity_bytes(400) == 200  # never more than the node has
    assert spec.high_water_bytes(1000) == 270 and spec.low_water_bytes(1000) == 150
    assert spec.is_expired(100) and not spec.is_expired(99.9)
    assert not TierPolicySpec(tier="host").is_expired(10**9)
