"""The L1 device pool: fixed pages, O(1) free list, no page reused under a reader."""

from __future__ import annotations

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import BlockMissing, TierFull

LAYOUT = layout_of(SMALL, "float16")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_pages_fill_free_and_refill(device: str, open_tier) -> None:
    tier = open_tier("device", LAYOUT, blocks=3, device=device)
    assert tier.pages == 3
    blocks = [torch.full((LAYOUT.block_bytes,), n, dtype=torch.uint8) for n in range(5)]
    for n in range(3):
        tier.put(key(n), blocks[n])
    with pytest.raises(TierFull):
        tier.put(key(3), blocks[3])
    assert tier.usage().free_bytes == 0
    tier.delete(key(1))
    tier.put(key(3), blocks[3])
    for n in (0, 2, 3):
        out = LAYOUT.empty()
        tier.get(key(n), out)
        assert torch.equal(out, blocks[n])
    assert torch.equal(tier.page(key(3)).cpu(), blocks[3])
    with pytest.raises(BlockMissing):
        tier.page(key(1))


def test_a_page_is_not_reused_while_a_reader_holds_it(open_tier) -> None:
    tier = open_tier("device", LAYOUT, blocks=1)
    tier.put(key(1), torch.ones(LAYOUT.block_bytes, dtype=torch.uint8))
    held = tier._acquire(key(1))
    tier.delete(key(1))
    with pytest.raises(TierFull):  # the only page is still being read
        tier.put(key(2), torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8))
    tier._release(held)
    tier.put(key(2), torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8))


def test_checksum_handed_in_is_kept_for_moving_down(open_tier, hasher) -> None:
    tier = open_tier("device", LAYOUT, blocks=1)
    block = torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8)
    checksum = hasher.checksum(key(1), block, LAYOUT)
    tier.put(key(1), block, checksum=checksum)
    assert tier.get(key(1), LAYOUT.empty()).checksum == checksum == tier.checksum(key(1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_of_many_blocks_lands_exactly_back_to_back_or_scattered(device: str, open_tier) -> None:
    """One gather serves destinations that lie back to back in one buffer; scattered ones, a
    missing block among them and a layer range are served too, each block exactly."""
    tier = open_tier("device", LAYOUT, blocks=6, device=device)
    blocks = {n: torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8) for n in range(6)}
    for n in (5, 0, 3, 1, 4, 2):  # pages in another order than the keys
        tier.put(key(n), blocks[n])
    keys = [key(n) for n in (2, 0, 4, 9, 1, 5)]  # key 9 is not stored
    for selected in (0, LAYOUT.layers - 1, range(1, 3)):
        span = LAYOUT.layer_range(selected)
        offset, nbytes = LAYOUT.span(span)
        buffer = torch.zeros(len(keys) * nbytes, dtype=torch.uint8, device=device)
        adjacent = list(buffer.view(len(keys), nbytes).unbind(0))
        scattered = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in keys]
        mixed = adjacent[:3] + scattered[3:]
        for outs in (adjacent, scattered, mixed):
            futures = tier.get_layers(keys, selected, outs)
            for position, (n, future) in enumerate(zip((2, 0, 4, 9, 1, 5), futures, strict=True)):
                if n == 9:
                    with pytest.raises(BlockMissing):
                        future.result(timeout=30)
                    continue
                assert future.result(timeout=30).layers == span
                assert torch.equal(outs[position].cpu(), blocks[n][offset : offset + nbytes]), (selected, n)
    tier.delete(key(0))
    tier.put(key(7), blocks[0])  # the pool is full: this takes the page the reads held, released


def test_back_to_back_runs_are_found_in_one_storage_only() -> None:
    from worker.dataplane.tiers.device import _adjacent_runs  # noqa: PLC0415

    one = torch.zeros(40, dtype=torch.uint8)
    other = torch.zeros(40, dtype=torch.uint8)
    views = [one[0:10], one[10:20], one[30:40], other[0:10], other[10:20], one[20:30]]
    assert _adjacent_runs(views, 10) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert _adjacent_runs([], 10) == []
