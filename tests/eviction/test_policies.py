"""The policies in force reach a node's eviction: the engine hands them to the write-back evictor
and the device working set, all or nothing; the working set follows a changed device policy."""

from __future__ import annotations

import copy

import pytest

from tests.dataplane.dataplane_support import ODD, key, layout_of, make_block
from tests.engine.conftest import engine_for
from worker.dataplane.engine.working_set import WorkingSet
from worker.dataplane.eviction.rules import TierRule
from worker.dataplane.tiers.device import DeviceTier

PAYLOAD = {
    "classes": [
        {"name": "default", "weight": 1.0, "device_share": 1.0, "namespaces": [], "remote_write": "on-demotion"},
        {"name": "batch", "weight": 0.5, "device_share": 0.25, "namespaces": ["bulk"], "remote_write": "on-demotion"},
    ],
    "tiers": [
        {"tier": "device", "node_group": "", "algorithm": "lfu", "ttl_seconds": None, "min_accesses": 0},
        {"tier": "host", "node_group": "", "algorithm": "s3fifo", "ttl_seconds": 900, "min_accesses": 2},
    ],
    "quotas": [{"namespace": "bulk", "tier": "host", "bytes": 1 << 20}],
}


@pytest.fixture
def engine(models, make_store):
    model = models("tiny", "float32")
    engine = engine_for(model, make_store(model, ("device", "host"), blocks=8), keep_in_device=True)
    yield engine
    engine.close()


def test_the_engine_applies_tier_policies_classes_and_quotas(engine):
    rules = engine.apply_policies(version=3, **PAYLOAD)
    assert engine.offload.evictor.rules is rules
    assert rules.tier("host") == TierRule("host", algorithm="s3fifo", ttl_seconds=900, min_accesses=2)
    assert rules.quota("bulk", "host") == 1 << 20 and rules.weight("bulk") == 0.5
    assert engine.working_set.rule == TierRule("device", algorithm="lfu")
    assert engine.working_set.version == 3 and engine.working_set.class_of("bulk") == "batch"


@pytest.mark.parametrize(
    ("part", "index", "field", "value", "named"),
    [
        ("tiers", 1, "algorithm", "fifo", "tiers[1].algorithm"),
        ("tiers", 0, "min_accesses", -1, "tiers[0].min_accesses"),
        ("quotas", 0, "bytes", "lots", "quotas[0].bytes"),
        ("classes", 1, "device_share", 3, "classes[1].device_share"),
        ("classes", 0, "weight", -2, "classes[0].weight"),
    ],
)
def test_a_bad_payload_is_refused_whole(engine, part, index, field, value, named):
    before = engine.apply_policies(version=1, **PAYLOAD)
    bad = copy.deepcopy(PAYLOAD)
    bad[part][index][field] = value
    with pytest.raises(ValueError, match="^" + named.replace("[", r"\[").replace("]", r"\]") + ":"):
        engine.apply_policies(version=2, **bad)
    assert engine.offload.evictor.rules is before
    assert engine.working_set.version == 1 and engine.working_set.rule.algorithm == "lfu"


def test_the_node_refuses_a_bad_tier_policy_before_keeping_anything(engine):
    from worker.dataplane.config import load_config
    from worker.node import NodeRuntime

    runtime = NodeRuntime(load_config(environ={}))
    runtime.engine = engine
    assert runtime.apply_policies(version=4, **PAYLOAD)
    bad = copy.deepcopy(PAYLOAD)
    bad["tiers"][0]["ttl_seconds"] = "soon"
    with pytest.raises(ValueError, match=r"^tiers\[0\]\.ttl_seconds:"):
        runtime.apply_policies(version=5, **bad)
    assert runtime.policy_version == 4 and runtime.policy_tiers == PAYLOAD["tiers"]
    assert engine.offload.evictor.rules.tier("host").algorithm == "s3fifo"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool():
    layout = layout_of(ODD, "float32")
    tier = DeviceTier(layout=layout, capacity_bytes=4 * layout.block_bytes, device="cpu")
    yield tier, layout
    tier.close()


def fill(ws: WorkingSet, clock: Clock, block) -> None:
    """Four blocks; block 0 used five times, the others once."""
    for n in range(4):
        clock.now += 1
        ws.put(key(n), block, namespace="chat")
    for _ in range(5):
        clock.now += 1
        ws.touch(key(0))
    for n in (1, 2, 3):
        clock.now += 1
        ws.touch(key(n))


def test_the_device_working_set_follows_a_changed_policy(pool):
    tier, layout = pool
    block = make_block(layout, seed=4)
    clock = Clock()
    ws = WorkingSet(tier, clock=clock)
    fill(ws, clock, block)
    ws.put(key(10), block, namespace="chat")  # LRU: block 0 was used longest ago
    assert not tier.contains(key(0))
    for n in [1, 2, 3, 10]:
        ws.forget(key(n))
        tier.delete(key(n))
    ws.set_rule(TierRule("device", algorithm="lfu"))
    fill(ws, clock, block)
    ws.put(key(11), block, namespace="chat")  # LFU: block 0 (used 6 times) stays
    assert tier.contains(key(0)) and not tier.contains(key(1)) and tier.contains(key(11))


def test_the_device_working_set_drops_blocks_past_a_new_ttl_and_under_min_accesses(pool):
    tier, layout = pool
    block = make_block(layout, seed=5)
    clock = Clock()
    ws = WorkingSet(tier, clock=clock)
    fill(ws, clock, block)
    clock.now += 100
    ws.touch(key(2))
    ws.set_rule(TierRule("device", ttl_seconds=50))  # idle past 50 s: all but block 2 leave now
    assert [n for n in range(4) if tier.contains(key(n))] == [2]
    assert ws.counters.get("device.expired") == 3
    ws.set_rule(TierRule("device", min_accesses=3))
    for n in (20, 21, 22):
        clock.now += 1
        ws.put(key(n), block, namespace="chat")
    clock.now += 1
    ws.put(key(23), block, namespace="chat")  # block 2 (3 uses) outlives the newer blocks used once
    assert tier.contains(key(2)) and not tier.contains(key(20))
