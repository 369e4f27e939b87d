"""The remote tier's shared usage hash recounted from what Redis holds, on a real Redis, beside
writers of other clients (other nodes): values removed behind Strata's back keep the tier full
until a recount; a reservation whose writer died lapses with its lease; a recount keeps a put's
reservation in flight and counts once every put and delete that lands while it walks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from dataplane_support import SMALL, key, layout_of

from tests.support import remote_held as held
from worker.dataplane.errors import TierFull
from worker.dataplane.tiers.remote import RemoteTier
from worker.dataplane.tiers.remote import tier as remote_tier_module
from worker.dataplane.tiers.remote.accounting import UsageHash

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks


def counted(tier: RemoteTier) -> tuple[int, int, int]:
    usage = tier.usage()
    return usage.stored_bytes, usage.blocks, usage.pending_bytes


def assert_true_to_the_store(tier: RemoteTier) -> None:
    nbytes, blocks = held(tier.client, tier.prefix)
    assert counted(tier) == (nbytes, blocks, 0)


@pytest.fixture
def two_nodes(open_tier) -> Callable[..., tuple[RemoteTier, RemoteTier]]:
    """Two remote tiers on the same Redis and prefix, each with its own client: two nodes."""

    def build(*, blocks: int = 8, **options) -> tuple[RemoteTier, RemoteTier]:
        first = open_tier("remote", LAYOUT, blocks=blocks, **options)
        second = open_tier("remote", LAYOUT, blocks=blocks, **options)
        second.capacity_bytes = first.capacity_bytes
        return first, second

    return build


def walk_hook(monkeypatch, tier: RemoteTier, after: int, hook: Callable[[], None]) -> None:
    """Run `hook` while `tier`'s next recount walks, once it has counted `after` + 1 batches."""
    real = tier._usage._batches

    def batches(batch: int) -> Iterator[list[bytes]]:
        for i, names in enumerate(real(batch)):
            yield names
            if i == after:
                hook()

    monkeypatch.setattr(tier._usage, "_batches", batches)


def test_values_removed_behind_strata_keep_the_tier_full_until_a_recount(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, capacity_bytes=0)
    tier.capacity_bytes = 4 * tier.value_bytes
    for n in range(4):
        tier.put(key(n), block_cache(LAYOUT, n))
    tier.client.delete(tier.key_name(key(0)), tier.key_name(key(1)))  # evicted, or deleted by hand
    with pytest.raises(TierFull):
        tier.put(key(4), block_cache(LAYOUT, 4))
    assert counted(tier) == (4 * tier.value_bytes, 4, 0)

    recount = tier.recount()
    assert recount is not None
    assert (recount.drift_bytes, recount.drift_blocks) == (2 * tier.value_bytes, 2)
    assert recount.usage == tier.usage()
    assert_true_to_the_store(tier)
    tier.put(key(4), block_cache(LAYOUT, 4))  # refused before the recount
    tier.put(key(5), block_cache(LAYOUT, 5))
    assert_true_to_the_store(tier)
    assert not tier.recount().corrected


def test_a_dead_writers_reservation_lapses_with_its_lease(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, capacity_bytes=0, lease_s=0.5)
    tier.capacity_bytes = 2 * tier.value_bytes
    tier.put(key(1), block_cache(LAYOUT, 1))
    # A writer that reserved room and died before its SET: what it leaves in the hash.
    field, _ = tier._usage.reserve(key(2), size=tier.value_bytes, before=0, capacity=tier.capacity_bytes)
    assert field is not None
    assert counted(tier) == (tier.value_bytes, 1, tier.value_bytes)
    with pytest.raises(TierFull):
        tier.put(key(3), block_cache(LAYOUT, 3))
    time.sleep(0.6)
    tier.put(key(3), block_cache(LAYOUT, 3))  # short of room, the put pruned the lapsed reservation
    assert_true_to_the_store(tier)


def test_a_recount_keeps_the_reservation_of_a_put_in_flight_on_another_node(
    two_nodes, block_cache, monkeypatch
) -> None:
    recounting, writing = two_nodes(blocks=4)
    recounting.capacity_bytes = writing.capacity_bytes = 3 * recounting.value_bytes
    recounting.put(key(1), block_cache(LAYOUT, 1))
    recounting.client.delete(recounting.key_name(key(1)))  # a drift for the recount to correct
    recounting.put(key(2), block_cache(LAYOUT, 2))
    at_set, go_on = threading.Event(), threading.Event()
    real_set = remote_tier_module.set_without_join

    def paused_set(client, name, header, data):
        if client is writing.client:
            at_set.set()
            assert go_on.wait(30)
        return real_set(client, name, header, data)

    monkeypatch.setattr(remote_tier_module, "set_without_join", paused_set)
    put = threading.Thread(target=writing.put, args=(key(3), block_cache(LAYOUT, 3)))
    put.start()
    try:
        assert at_set.wait(30)  # reserved, its value not sent yet
        recount = recounting.recount()
        assert recount is not None and (recount.drift_bytes, recount.drift_blocks) == (recounting.value_bytes, 1)
        assert counted(recounting) == (recounting.value_bytes, 1, recounting.value_bytes)  # the reservation stays
        recounting.put(key(4), block_cache(LAYOUT, 4))
        with pytest.raises(TierFull):  # 2 stored + the put in flight fill the tier
            recounting.put(key(5), block_cache(LAYOUT, 5))
    finally:
        go_on.set()
        put.join(30)
    assert_true_to_the_store(recounting)
    assert counted(recounting)[:2] == (3 * recounting.value_bytes, 3)
    assert not recounting.recount().corrected


def test_a_put_between_its_set_and_its_settle_during_a_recount_is_counted_once(
    two_nodes, block_cache, monkeypatch
) -> None:
    recounting, writing = two_nodes()
    recounting.put(key(1), block_cache(LAYOUT, 1))
    at_settle, go_on = threading.Event(), threading.Event()
    real_settle = writing._usage.settle

    def paused_settle(field: bytes, *, nbytes: int = 0, blocks: int = 0) -> None:
        if nbytes:
            at_settle.set()
            assert go_on.wait(30)
        real_settle(field, nbytes=nbytes, blocks=blocks)

    monkeypatch.setattr(writing._usage, "settle", paused_settle)
    put = threading.Thread(target=writing.put, args=(key(2), block_cache(LAYOUT, 2)))
    put.start()
    try:
        assert at_settle.wait(30)  # its value is in Redis, not yet in the hash
        assert held(recounting.client, recounting.prefix)[1] == 2
        recount = recounting.recount()
        assert recount is not None and not recount.corrected
    finally:
        go_on.set()
        put.join(30)
    assert_true_to_the_store(recounting)
    assert counted(recounting)[1] == 2


@pytest.mark.parametrize("after", [0, 3, 6])
def test_puts_and_deletes_landing_while_a_recount_walks_are_counted_once(
    after: int, two_nodes, block_cache, monkeypatch
) -> None:
    """Whether the walk passed a block's key before or after the other node changed it (it
    walks one key a batch: 7 batches, the changes land after the first, the fourth, the last)."""
    recounting, writing = two_nodes(blocks=16)
    for n in range(8):
        recounting.put(key(n), block_cache(LAYOUT, n))
    recounting.client.delete(recounting.key_name(key(7)))  # a drift for the recount to correct

    ran: list[bool] = []

    def other_node() -> None:
        ran.append(True)
        for n in (20, 22, 23):  # new (more puts than deletes, so no error can cancel another)
            writing.put(key(n), block_cache(LAYOUT, n))
        writing.put(key(1), block_cache(LAYOUT, 2))  # overwritten
        writing.delete(key(2))
        writing.delete(key(3))
        writing.put(key(3), block_cache(LAYOUT, 3))  # deleted, then stored again
        writing.put(key(21), block_cache(LAYOUT, 21))
        writing.delete(key(21))  # stored, then deleted

    walk_hook(monkeypatch, recounting, after, other_node)
    recount = recounting.recount(batch=1)
    assert ran == [True]
    assert recount is not None and (recount.drift_bytes, recount.drift_blocks) == (recounting.value_bytes, 1)
    assert_true_to_the_store(recounting)
    assert counted(recounting)[1] == 9  # 0..6 less 2, plus 3 again, 20, 22 and 23
    monkeypatch.undo()
    assert not recounting.recount().corrected


def test_one_recount_at_a_time(two_nodes, block_cache, monkeypatch) -> None:
    first, second = two_nodes()
    for n in range(3):
        first.put(key(n), block_cache(LAYOUT, n))
    first.client.delete(first.key_name(key(0)))
    refused: list[object] = []
    walk_hook(monkeypatch, first, 0, lambda: refused.append(second.recount()))
    recount = first.recount(batch=1)
    assert refused == [None]  # the second found the first recounting: it changed nothing
    assert recount is not None and (recount.drift_bytes, recount.drift_blocks) == (first.value_bytes, 1)
    assert second.recount() is not None  # and may recount once the first is done
    assert_true_to_the_store(first)


def test_a_recount_that_fails_mid_walk_gives_the_hash_back_unchanged(open_tier, block_cache, monkeypatch) -> None:
    tier = open_tier("remote", LAYOUT, blocks=4)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.client.delete(tier.key_name(key(1)))
    before = counted(tier)

    def fail() -> None:
        raise redis.exceptions.ConnectionError("the connection dropped mid-walk")

    walk_hook(monkeypatch, tier, 0, fail)
    with pytest.raises(Exception, match="mid-walk"):
        tier.recount(batch=1)
    assert counted(tier) == before
    raw = tier.client.hgetall(f"{tier.prefix}:usage")
    assert b"recount" not in raw and not [f for f in raw if f.startswith((b"t:", b"i:"))]
    monkeypatch.undo()
    assert tier.recount().drift_blocks == 1


def test_a_recount_walks_in_bounded_batches(open_tier, block_cache, monkeypatch) -> None:
    tier = open_tier("remote", LAYOUT, blocks=8)
    for n in range(5):
        tier.put(key(n), block_cache(LAYOUT, n))
    sizes: list[int] = []
    real = UsageHash._batches

    def batches(self, batch: int) -> Iterator[list[bytes]]:
        for names in real(self, batch):
            sizes.append(len(names))
            yield names

    monkeypatch.setattr(UsageHash, "_batches", batches)
    assert not tier.recount(batch=2).corrected
    assert sum(sizes) >= 5 and max(sizes) <= 2
