"""A full host or disk tier makes room at write-back by its policy (real shared-memory and file tiers)."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.engine.conftest import BLOCK_TOKENS, layout_for
from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.errors import TierFull, TierUnavailable
from worker.dataplane.eviction.local import MAX_FAILED_DELETES
from worker.dataplane.eviction.rules import Rules, TierRule, parse_rules
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Hit
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.disk.headers import block_file_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Changes:
    """Records the placement changes a manager sends (the directory's other calls do nothing)."""

    def __init__(self) -> None:
        self.changes: list = []

    def register(self, *, blocks) -> None:
        pass

    def change_placements(self, *, changes) -> None:
        self.changes.extend(changes)

    def touch(self, *, touches) -> None:
        pass

    def namespace_salt(self, name: str) -> bytes:
        return name.encode()


def slots_for(model, tier: str, blocks: int) -> int:
    """The `blocks` argument of make_store that holds `blocks` whole blocks in `tier` (a disk
    file carries a header besides the block)."""
    layout = layout_for(model)
    return blocks if tier != "disk" else -(-blocks * block_file_bytes(layout) // layout.block_bytes)


def manager(store: TieredStore, model, tier: str = "host", **options) -> OffloadManager:
    return OffloadManager(store=store, profile=model.profile(BLOCK_TOKENS), write_back_tier=tier, **options)


def key(name: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_OID, name)


def write(mgr: OffloadManager, names: list[str], *, namespace: str = "a", start: int = 0) -> list[bool]:
    """One write-back batch: a block per name (in prompt order), then the batch is registered."""
    block = mgr.layout.empty()
    registrations, stored = [], []
    for i, name in enumerate(names):
        block.copy_(torch.randint(0, 255, block.shape, dtype=torch.uint8))
        reg = mgr.store_block(
            key=key(name),
            content_key=key(name + "/c"),
            position=(start + i) * BLOCK_TOKENS,
            namespace=namespace,
            data=block,
        )
        stored.append(reg is not None)
        if reg is not None:
            registrations.append(reg)
    mgr.register(registrations)
    return stored


def held(store: TieredStore, tier: str, names: list[str]) -> list[str]:
    present = store.tier(tier).contains_many([key(n) for n in names])
    return [n for n, here in zip(names, present, strict=True) if here]


def use(mgr: OffloadManager, names: list[str], tier: str = "host") -> None:
    """A request that reuses `names` and stores nothing new."""
    mgr.note_hits([Hit(index=i, key=key(n), tier=tier) for i, n in enumerate(names)])
    mgr.register([])


def burst(mgr: OffloadManager, clock: Clock, *, hot: list[str], batches: int, tier: str = "host") -> tuple[int, int]:
    """Hot blocks used before each batch of 4 new ones; returns (new blocks stored, new blocks)."""
    stored = total = 0
    for b in range(batches):
        clock.now += 1
        use(mgr, hot, tier)
        clock.now += 1
        names = [f"new-{b}-{i}" for i in range(4)]
        stored += sum(write(mgr, names))
        total += len(names)
    return stored, total


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("algorithm", ["lru", "lfu", "s3fifo", "cost-aware"])
def test_a_burst_of_three_times_the_pool_keeps_hot_and_pinned_blocks_and_stores_every_new_one(
    models, make_store, tier, algorithm
):
    model = models("tiny")
    store = make_store(model, (tier,), blocks=slots_for(model, tier, 8))
    clock = Clock()
    directory = Changes()
    mgr = manager(store, model, tier, clock=clock, directory=directory)
    mgr.apply_rules(parse_rules(tiers=[{"tier": tier, "algorithm": algorithm}]))
    hot, pinned = ["hot-0", "hot-1"], ["pin-0"]
    assert all(write(mgr, [*hot, *pinned]))
    mgr.evictor.ledger.pin([key("pin-0")])
    stored, total = burst(mgr, clock, hot=hot, batches=6, tier=tier)  # 24 new blocks into 8 slots
    assert (stored, total) == (24, 24)  # every new block stored while colder ones sat in the tier
    assert held(store, tier, [*hot, *pinned]) == [*hot, *pinned]
    evicted = mgr.counters.get(f"eviction.{tier}.pressure")
    assert evicted == 24 - (8 - 3) and store.tier(tier).usage().blocks == 8
    # each eviction told to the directory with the batch after it, as a delete of this node's copy
    assert len(directory.changes) == evicted
    assert {(c.action, c.tier, c.node) for c in directory.changes} == {("delete", tier, "local")}
    assert not {c.prefix_key for c in directory.changes} & {key(n) for n in [*hot, *pinned]}


def test_without_eviction_the_same_burst_loses_the_new_blocks(models, make_store):
    """The behaviour before local eviction, measured on the same pool: a full tier refuses."""
    model = models("tiny")
    store = make_store(model, ("host",), blocks=8)
    data = store.layout.empty()
    kept = 0
    for i in range(3 + 24):
        try:
            store.put(key(f"old-{i}"), data, tier="host")
            kept += 1
        except TierFull:
            pass
    assert kept - 3 == 5  # 5 of the 24 new blocks (21%) against 24 of 24 with eviction


def test_a_new_block_is_refused_only_when_nothing_colder_is_left(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    mgr = manager(store, model, clock=Clock())
    # one batch longer than the pool: its tail never evicts its own head
    assert write(mgr, [f"p{i}" for i in range(6)]) == [True] * 4 + [False] * 2
    assert held(store, "host", [f"p{i}" for i in range(6)]) == ["p0", "p1", "p2", "p3"]
    mgr.evictor.ledger.pin([key(f"p{i}") for i in range(4)])
    assert write(mgr, ["q0"]) == [False]  # everything pinned
    assert mgr.counters.get("write_back_refused.host.pressure") == 3
    text = EngineMetrics(mgr, "n1", model="tiny").render().decode()
    assert 'strata_write_back_refused_total{node="n1",reason="pressure",tier="host"} 3.0' in text


def test_lfu_keeps_the_often_used_block_where_lru_would_not(models, make_store):
    model = models("tiny")
    results = {}
    for algorithm in ("lru", "lfu"):
        store = make_store(model, ("host",), blocks=3)
        clock = Clock()
        mgr = manager(store, model, clock=clock)
        mgr.apply_rules(parse_rules(tiers=[{"tier": "host", "algorithm": algorithm}]))
        write(mgr, ["often"])
        for _ in range(5):
            clock.now += 1
            use(mgr, ["often"])
        clock.now += 1
        write(mgr, ["b"])
        clock.now += 1
        write(mgr, ["c"])
        clock.now += 1
        write(mgr, ["d"])
        results[algorithm] = held(store, "host", ["often", "b", "c", "d"])
    assert results == {"lru": ["b", "c", "d"], "lfu": ["often", "c", "d"]}


def test_blocks_idle_past_the_ttl_leave_even_with_room_to_spare(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=8)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    mgr.apply_rules(Rules(tiers={"host": TierRule("host", ttl_seconds=60)}))
    write(mgr, ["idle", "used"])
    clock.now += 50
    use(mgr, ["used"])
    clock.now += 20
    write(mgr, ["fresh"])
    assert held(store, "host", ["idle", "used", "fresh"]) == ["used", "fresh"]
    assert mgr.counters.get("eviction.host.ttl") == 1
    text = EngineMetrics(mgr, "n1", model="tiny").render().decode()
    assert 'strata_evictions_total{node="n1",reason="ttl",tier="host"} 1.0' in text


def test_a_namespace_flooding_under_its_quota_evicts_only_its_own_blocks(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=8)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    block = store.layout.block_bytes
    mgr.apply_rules(parse_rules(quotas=[{"namespace": "flood", "tier": "host", "bytes": 3 * block}]))
    calm = [f"calm-{i}" for i in range(4)]
    write(mgr, calm, namespace="calm")
    flood = [f"flood-{i}" for i in range(12)]
    for i in range(0, 12, 2):
        clock.now += 1
        assert write(mgr, flood[i : i + 2], namespace="flood") == [True, True]
    assert held(store, "host", calm) == calm  # the other namespace's blocks stay
    assert held(store, "host", flood) == ["flood-8", "flood-10", "flood-11"]  # a batch's head stays
    assert mgr.counters.get("eviction.host.quota") == 9 and not mgr.counters.get("eviction.host.pressure")
    assert mgr.evictor.ledger.bytes_of("host", "flood") == 3 * block


def test_a_write_over_a_quota_with_nothing_of_its_own_to_evict_is_refused(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=8)
    mgr = manager(store, model, clock=Clock())
    mgr.apply_rules(parse_rules(quotas=[{"namespace": "none", "tier": "host", "bytes": 0}]))
    assert write(mgr, ["x"], namespace="none") == [False]
    assert mgr.counters.get("write_back_refused.host.quota") == 1 and mgr.counters.get("write_back.host.refused") == 1
    assert store.tier("host").usage().blocks == 0


def test_a_request_extending_its_hits_evicts_other_blocks_not_its_own_prefix(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    write(mgr, ["p0", "p1"])
    clock.now += 1
    write(mgr, ["q0", "q1"])
    clock.now += 1
    # the request hits p0 p1 (the oldest blocks) and writes the two blocks after them
    mgr.note_hits([Hit(index=i, key=key(n), tier="host") for i, n in enumerate(["p0", "p1"])])
    assert write(mgr, ["p2", "p3"], start=2) == [True, True]
    assert held(store, "host", ["p0", "p1", "p2", "p3", "q0", "q1"]) == ["p0", "p1", "p2", "p3"]


def test_blocks_a_movement_put_in_are_adopted_and_ones_it_took_out_forgotten(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    write(mgr, ["a0", "a1"])
    store.put(key("moved-in"), store.layout.empty(), tier="host")  # a movement's copy, not written back here
    store.tier("host").delete(key("a1"))  # a movement's freed source
    clock.now += 1
    write(mgr, ["b0", "b1"])  # fits: moved-in, a0, b0, b1
    clock.now += 1
    assert write(mgr, ["c0"]) == [True]  # full: the ledger learns moved-in and forgets a1
    assert mgr.evictor.ledger.get("host", key("a1")) is None
    assert mgr.evictor.ledger.get("host", key("moved-in")) is not None
    assert held(store, "host", ["a0", "moved-in", "b0", "b1", "c0"]) == ["moved-in", "b0", "b1", "c0"]
    clock.now += 100
    use(mgr, ["b0", "b1"])
    use(mgr, ["c0"])
    clock.now += 1
    assert write(mgr, ["d0"]) == [True]  # the adopted block (used once, when adopted) is now the coldest
    assert held(store, "host", ["moved-in", "b0", "b1", "c0", "d0"]) == ["b0", "b1", "c0", "d0"]
    assert mgr.counters.get("eviction.unreported") == 1  # its namespace is unknown here


def test_a_victim_whose_delete_fails_stays_and_the_next_coldest_goes(models, make_store, monkeypatch):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    for names in (["a0"], ["b0"], ["c0", "c1"]):  # full, a0 the coldest
        write(mgr, names)
        clock.now += 1
    tier = store.tier("host")
    real_delete = tier.delete

    def delete(block_key: uuid.UUID) -> bool:
        if block_key == key("a0"):
            raise TierUnavailable("host", reason="deleting a0 failed: EIO")
        return real_delete(block_key)

    monkeypatch.setattr(tier, "delete", delete)
    assert write(mgr, ["d0"]) == [True]  # a0's delete failed: b0, the next coldest, went
    assert held(store, "host", ["a0", "b0", "c0", "c1", "d0"]) == ["a0", "c0", "c1", "d0"]
    assert mgr.evictor.ledger.get("host", key("a0")) is not None  # kept, to be tried again
    assert mgr.counters.get("eviction_failed.host") == 1
    assert mgr.counters.get("eviction.host.pressure") == 1
    text = EngineMetrics(mgr, "n1", model="tiny").render().decode()
    assert 'strata_eviction_failures_total{node="n1",tier="host"} 1.0' in text
    monkeypatch.undo()
    clock.now += 1
    assert write(mgr, ["e0"]) == [True]  # a0, still the coldest, goes now
    assert held(store, "host", ["a0", "c0", "c1", "d0", "e0"]) == ["c0", "c1", "d0", "e0"]
    assert mgr.evictor.ledger.get("host", key("a0")) is None


def test_a_tier_failing_every_delete_fails_the_write_after_a_few_and_forgets_nothing(models, make_store, monkeypatch):
    model = models("tiny")
    store = make_store(model, ("host",), blocks=4)
    clock = Clock()
    mgr = manager(store, model, clock=clock)
    names = ["a0", "a1", "a2", "a3"]
    write(mgr, names)
    clock.now += 1
    tier = store.tier("host")
    tries: list[uuid.UUID] = []

    def delete(block_key: uuid.UUID) -> bool:
        tries.append(block_key)
        raise TierUnavailable("host", reason="the medium is gone")

    monkeypatch.setattr(tier, "delete", delete)
    assert write(mgr, ["b0"]) == [False]  # the delete's error fails this block's write-back
    assert len(tries) == MAX_FAILED_DELETES == mgr.counters.get("eviction_failed.host")
    assert mgr.counters.get("write_back.host.failed") == 1
    assert sorted(s.key for s in mgr.evictor.ledger.stats("host")) == sorted(key(n) for n in names)
    monkeypatch.undo()
    assert write(mgr, ["b0"]) == [True]
    assert mgr.counters.get("eviction.host.pressure") == 1
