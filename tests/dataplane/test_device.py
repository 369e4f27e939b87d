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


def test_checksum_handed_in_is_kept_for_moving_down(open_tier, engine) -> None:
    tier = open_tier("device", LAYOUT, blocks=1)
    block = torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8)
    checksum = engine.checksum(key(1), block, LAYOUT)
    tier.put(key(1), block, checksum=checksum)
    assert tier.get(key(1), LAYOUT.empty()).checksum == checksum == tier.checksum(key(1))
