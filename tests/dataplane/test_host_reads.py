"""Host tier reads into and writes from host memory: the native path (one call per attempt checks
the slot, copies, hashes and compares; one call per put copies, hashes and records) and the
interpreter's path (no fused routine) give the same answers, the same errors and the same counts."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dataplane_support import key, layout_of, make_block

from worker.dataplane import native
from worker.dataplane.checksum import BlockChecksum, Hasher, layer_checksum
from worker.dataplane.errors import BlockCorrupt, BlockMissing
from worker.dataplane.native import available as native_available
from worker.dataplane.tiers.host import HostTier

LAYOUT = layout_of({"layers": 4, "kv_heads": 2, "head_dim": 64, "block_tokens": 128}, "float16")
BIG = layout_of({"layers": 8, "kv_heads": 8, "head_dim": 128, "block_tokens": 256}, "bfloat16")
"""8 MiB blocks: a copy long enough for another thread to change the slot during it."""

PATHS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not native_available(), reason="not built")),
    pytest.param(False, id="interpreter"),
]


@pytest.fixture(params=PATHS)
def host(request, shm_name):
    opened: list[HostTier] = []
    hasher = Hasher(threads=2, native=request.param)

    def build(layout=LAYOUT, blocks: int = 4, name: str = shm_name) -> HostTier:
        tier = HostTier(
            layout=layout,
            capacity_bytes=blocks * (layout.block_bytes + 4096),
            pool_name=name,
            hasher=hasher,
        )
        opened.append(tier)
        return tier

    yield build
    for tier in opened:
        tier.close()
    hasher.close()


def test_whole_blocks_and_layer_ranges_read_back_exactly_with_their_checksums(host) -> None:
    tier = host(blocks=6)
    blocks = {n: make_block(LAYOUT, seed=n) for n in range(5)}
    put = {n: tier.put(key(n), data) for n, data in blocks.items()}
    for n, data in blocks.items():
        out = LAYOUT.empty()
        result = tier.get(key(n), out)
        assert torch.equal(out, data)
        assert result.checksum == put[n].checksum and result.nbytes == LAYOUT.block_bytes
    outs = [LAYOUT.empty(layers=2) for _ in blocks]
    results = [f.result(timeout=30) for f in tier.get_layers([key(n) for n in blocks], range(1, 3), outs)]
    for n, out in zip(blocks, outs, strict=True):
        assert torch.equal(out, blocks[n][LAYOUT.layer_bytes : 3 * LAYOUT.layer_bytes])
    assert all(r.checksum is None and r.nbytes == 2 * LAYOUT.layer_bytes for r in results)
    # A batch mixing hits and a miss: the miss fails alone.
    futures = tier.get_many([key(0), key(99), key(4)], [LAYOUT.empty() for _ in range(3)])
    assert futures[0].result(timeout=30).key == key(0)
    with pytest.raises(BlockMissing):
        futures[1].result(timeout=30)
    assert futures[2].result(timeout=30).key == key(4)
    stats = tier.counters.snapshot()
    assert stats["host.hits"] == 5 + 5 + 2 and stats["host.misses"] == 1
    assert stats["host.bytes_read"] == 7 * LAYOUT.block_bytes + 5 * 2 * LAYOUT.layer_bytes


@pytest.mark.parametrize("layer", [0, 3])
def test_a_flipped_byte_names_its_layer_and_is_quarantined(host, layer: int) -> None:
    tier = host()
    tier.put(key(1), make_block(LAYOUT, seed=1))
    tier.put(key(2), make_block(LAYOUT, seed=2))
    slot = tier._find(key(1))
    tier._data[slot * tier.slot_bytes + layer * LAYOUT.layer_bytes + 5] ^= 0x10
    with pytest.raises(BlockCorrupt, match=f"layer {layer} checksum mismatch"):
        tier.get(key(1), LAYOUT.empty())
    assert tier.counters.get("host.corrupt") == 1 and not tier.contains(key(1))
    out = LAYOUT.empty()
    tier.get(key(2), out)  # the other block is untouched
    assert torch.equal(out, make_block(LAYOUT, seed=2))


def test_a_slot_recording_another_size_is_corrupt(host) -> None:
    tier = host()
    tier.put(key(1), make_block(LAYOUT, seed=1))
    slot = tier._find(key(1))
    tier._nbytes[slot] = LAYOUT.block_bytes - 4096
    with pytest.raises(BlockCorrupt, match=f"slot records {LAYOUT.block_bytes - 4096} bytes"):
        tier.get(key(1), LAYOUT.empty())
    assert not tier.contains(key(1))


def test_a_block_checksum_that_disagrees_with_its_layers_fails_whole_reads_only(host) -> None:
    tier = host()
    data = make_block(LAYOUT, seed=1)
    tier.put(key(1), data)
    slot = tier._find(key(1))
    tier._block_sums[slot, 0] ^= 0xFF
    # Every layer still matches its own checksum, so a layer read is served...
    out = LAYOUT.empty(layers=1)
    tier.get_layers([key(1)], 2, [out])[0].result(timeout=30)
    assert torch.equal(out, data[2 * LAYOUT.layer_bytes : 3 * LAYOUT.layer_bytes])
    # ...but a whole read, which returns the block checksum, is not.
    with pytest.raises(BlockCorrupt, match="block checksum does not match its layers"):
        tier.get(key(1), LAYOUT.empty())
    assert not tier.contains(key(1))


def test_a_slot_reused_by_another_process_is_never_read_for_the_old_key(host, shm_name) -> None:
    """This mapping remembers where key 1 was; another one evicts it and stores key 2 in the same
    slot. Reading key 1 here is a miss, and key 2 reads back exactly."""
    here = host(blocks=1)
    there = host(blocks=1, name=shm_name)
    here.put(key(1), make_block(LAYOUT, seed=1))
    here.get(key(1), LAYOUT.empty())
    there.delete(key(1))
    there.put(key(2), make_block(LAYOUT, seed=2))
    assert here._lookup.get(key(1)) == there._find(key(2))  # the stale entry points at key 2
    with pytest.raises(BlockMissing):
        here.get(key(1), LAYOUT.empty())
    out = LAYOUT.empty()
    here.get(key(2), out)
    assert torch.equal(out, make_block(LAYOUT, seed=2))
    assert here.counters.get("host.corrupt") == 0


def test_a_slot_changed_during_the_copy_is_retried_and_never_served_torn(host) -> None:
    """Another thread moves the slot's generation on (odd, then even: what a writer does) over and
    over while this one reads an 8 MiB block: reads that overlap a change are discarded and
    retried (counted), a read that never finds a quiet moment is a miss, and nothing is served
    from a changed slot or reported corrupt. When the changes stop, the block reads back."""
    tier = host(layout=BIG, blocks=1)
    data = make_block(BIG, seed=3)
    tier.put(key(1), data)
    slot = tier._find(key(1))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            tier._gen[slot] += 1
            time.sleep(0.0002)
            tier._gen[slot] += 1
            time.sleep(0.0005)

    churner = threading.Thread(target=churn)
    churner.start()
    out = BIG.empty()
    try:
        deadline = time.monotonic() + 20
        while tier.counters.get("host.torn_retries") < 3 and time.monotonic() < deadline:
            out.zero_()
            try:
                tier.get(key(1), out)
                assert torch.equal(out, data)
            except BlockMissing:
                pass
    finally:
        stop.set()
        churner.join()
    assert tier.counters.get("host.torn_retries") >= 3
    assert tier.counters.get("host.corrupt") == 0
    out.zero_()
    tier.get(key(1), out)
    assert torch.equal(out, data)


def test_a_put_records_the_checksums_of_the_bytes_it_stored(host) -> None:
    """Whether hashed by the put (alone or in a batch) or given by the caller, the slot records the
    checksums of exactly the stored bytes, and the put returns them."""
    tier = host(blocks=4)
    blocks = {n: make_block(LAYOUT, seed=10 + n) for n in range(3)}

    def reference(n: int) -> BlockChecksum:
        data = blocks[n].numpy().tobytes()
        lb = LAYOUT.layer_bytes
        return BlockChecksum.from_layers(
            key(n),
            [layer_checksum(key(n), j, data[j * lb : (j + 1) * lb]) for j in range(LAYOUT.layers)],
        )

    assert tier.put(key(0), blocks[0]).checksum == reference(0)
    futures = tier.put_many([(key(1), blocks[1]), (key(2), blocks[2])], checksums=[None, reference(2)])
    assert [f.result(timeout=30).checksum for f in futures] == [reference(1), reference(2)]
    for n in blocks:
        slot = tier._find(key(n))
        assert tier._block_sums[slot].tobytes() == reference(n).block
        assert tier._sums[slot].tobytes() == b"".join(reference(n).layers)
        assert int(tier._nbytes[slot]) == LAYOUT.block_bytes
        out = LAYOUT.empty()
        assert tier.get(key(n), out).checksum == reference(n)
        assert torch.equal(out, blocks[n])


@pytest.mark.skipif(not native_available(), reason="not built")
def _fill_with(data: torch.Tensor, checksum: BlockChecksum):
    def fill(slot: torch.Tensor) -> BlockChecksum:
        slot.copy_(data.view(-1).view(torch.uint8))
        return checksum

    return fill


def test_a_block_written_in_place_reads_back_and_replaces_the_older_copy(host) -> None:
    tier = host(blocks=3)
    hasher = Hasher(threads=1)
    old, new = make_block(LAYOUT, seed=1), make_block(LAYOUT, seed=2)
    tier.put(key(1), old)
    result = tier.put_from(key(1), _fill_with(new, hasher.checksum(key(1), new, LAYOUT)))
    out = LAYOUT.empty()
    read = tier.get(key(1), out)
    assert torch.equal(out, new) and read.checksum == result.checksum
    assert tier.keys() == [key(1)] and tier.usage().used_bytes == LAYOUT.block_bytes


def test_a_fill_that_fails_stores_nothing_and_gives_its_slot_back(host) -> None:
    tier = host(blocks=2)
    kept = make_block(LAYOUT, seed=3)
    tier.put(key(1), kept)

    def fails(slot: torch.Tensor) -> BlockChecksum:
        slot.fill_(7)  # half-written when the source gives out
        raise ConnectionError("the source went away")

    with pytest.raises(ConnectionError, match="the source went away"):
        tier.put_from(key(2), fails)
    assert not tier.contains(key(2))
    tier.put(key(3), make_block(LAYOUT, seed=4))  # the slot is free again: the pool holds two
    out = LAYOUT.empty()
    tier.get(key(1), out)
    assert torch.equal(out, kept) and sorted(tier.keys()) == sorted([key(1), key(3)])


def test_a_fill_with_a_checksum_of_other_layers_is_refused_and_stores_nothing(host) -> None:
    tier = host(blocks=2)
    data = make_block(LAYOUT, seed=5)
    whole = Hasher(threads=1).checksum(key(1), data, LAYOUT)
    short = BlockChecksum.from_layers(key(1), whole.layers[:2])
    with pytest.raises(ValueError, match="checksum has 2 layers, the layout 4"):
        tier.put_from(key(1), _fill_with(data, short))
    assert not tier.contains(key(1)) and tier.usage().used_bytes == 0


def test_a_fill_whose_checksum_is_not_of_its_bytes_is_never_served(host) -> None:
    tier = host(blocks=2)
    data, other = make_block(LAYOUT, seed=6), make_block(LAYOUT, seed=7)
    tier.put_from(key(1), _fill_with(data, Hasher(threads=1).checksum(key(1), other, LAYOUT)))
    with pytest.raises(BlockCorrupt, match="layer 0 checksum mismatch"):
        tier.get(key(1), LAYOUT.empty())
    assert not tier.contains(key(1))


def test_the_native_pool_calls_refuse_mismatched_arguments(host) -> None:
    tier = host()
    out = LAYOUT.empty()
    with pytest.raises(ValueError, match="2 slots need 2 16-byte keys and 2 addresses, got 16 key"):
        native.pool_read(
            tier._pool_geometry,
            [0, 1],
            key(1).bytes,
            [out.data_ptr()] * 2,
            0,
            1,
            streaming=False,
            helpers=False,
        )
    with pytest.raises(ValueError, match="1 slots need 1 16-byte keys and 1 addresses, got 16 key bytes and 0"):
        native.pool_fill(tier._pool_geometry, [0], key(1).bytes, [], streaming=True, helpers=False)
    assert tier.usage().blocks == 0
