"""The engine's device working set: LRU within the pool, each priority class within its share."""

from __future__ import annotations

import pytest

from tests.dataplane.dataplane_support import ODD, key, layout_of, make_block
from worker.dataplane.engine.working_set import ClassShare, WorkingSet
from worker.dataplane.tiers.device import DeviceTier


@pytest.fixture
def pool():
    layout = layout_of(ODD, "float32")
    tier = DeviceTier(layout=layout, capacity_bytes=10 * layout.block_bytes, device="cpu")
    yield tier, layout
    tier.close()


def test_lru_evicts_the_oldest_block_when_the_pool_is_full(pool):
    tier, layout = pool
    ws = WorkingSet(tier)
    block = make_block(layout, seed=1)
    for n in range(10):
        assert ws.put(key(n), block, namespace="chat")
    ws.touch(key(0))
    assert ws.put(key(10), block, namespace="chat")
    assert not tier.contains(key(1)) and tier.contains(key(0)) and tier.contains(key(10))
    assert ws.used_bytes() == 10 * layout.block_bytes
    assert ws.counters.get("device.evicted") == 1


def test_a_class_never_holds_more_than_its_share(pool):
    tier, layout = pool
    ws = WorkingSet(tier)
    ws.set_shares([ClassShare("default", 1.0), ClassShare("batch", 0.3, ("bulk",))], version=7)
    block = make_block(layout, seed=2)
    for n in range(5):
        ws.put(key(n), block, namespace="chat")
    for n in range(100, 120):
        ws.put(key(n), block, namespace="bulk")
        assert ws.used_bytes("batch") <= 3 * layout.block_bytes
    # The batch class cycled through its own 3 pages; the realtime tenant kept every block.
    assert all(tier.contains(key(n)) for n in range(5))
    assert [tier.contains(key(n)) for n in (117, 118, 119)] == [True, True, True]
    assert ws.counters.get("device.share_evicted") == 17
    assert ws.usage_by_class() == {"batch": 3 * layout.block_bytes, "default": 5 * layout.block_bytes}
    assert ws.version == 7


def test_lowering_a_share_evicts_down_to_it_at_once(pool):
    tier, layout = pool
    ws = WorkingSet(tier)
    block = make_block(layout, seed=3)
    for n in range(8):
        ws.put(key(n), block, namespace="bulk")
    ws.set_shares([ClassShare("batch", 0.2, ("bulk",))])
    assert ws.used_bytes("batch") == 2 * layout.block_bytes
    assert [tier.contains(key(n)) for n in range(8)] == [False] * 6 + [True, True]


def test_a_zero_share_keeps_nothing_in_the_device_tier(pool):
    tier, layout = pool
    ws = WorkingSet(tier)
    ws.set_shares([ClassShare("batch", 0.0, ("bulk",))])
    assert not ws.put(key(1), make_block(layout, seed=4), namespace="bulk")
    assert not tier.contains(key(1))
    assert ws.counters.get("device.share_refused") == 1


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"name": "batch", "device_share": 1.5}, "device_share"),
        ({"name": "batch", "device_share": "half"}, "device_share"),
        ({"name": "", "device_share": 0.5}, "name"),
        ({"name": "batch", "namespaces": "bulk"}, "namespaces"),
    ],
)
def test_bad_classes_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        ClassShare.from_dict(bad)
