"""Every tier returns exactly the bytes it was given: whole blocks and layer ranges, every dtype, both layouts."""

from __future__ import annotations

import pytest
import torch
from dataplane_support import DTYPES, LLAMA, ODD, SMALL, key, layout_of

from worker.dataplane.buffers import aligned_empty
from worker.dataplane.errors import BlockMissing, TierFull

TIERS = ("device", "host", "disk", "remote")


@pytest.mark.parametrize("shape", [LLAMA, SMALL, ODD], ids=["llama", "small", "odd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TIERS)
def test_round_trip_is_exact(kind: str, dtype: str, shape: dict, open_tier, block_cache) -> None:
    layout = layout_of(shape, dtype)
    tier = open_tier(kind, layout, blocks=3)
    blocks = {key(1): block_cache(layout, 1), key(2): block_cache(layout, 2)}
    for k, block in blocks.items():
        result = tier.put(k, block)
        assert result.nbytes == layout.block_bytes
        assert (result.checksum is None) == (kind == "device")
    assert tier.contains(key(1)) and not tier.contains(key(9))
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0 and usage.stored_bytes >= 2 * layout.block_bytes

    for k, block in blocks.items():
        out = layout.empty()
        out.zero_()
        read = tier.get(k, out)
        assert read.tier == kind and read.layers == range(layout.layers)
        assert torch.equal(out, block)
        for (k_out, v_out), (k_in, v_in) in zip(layout.kv_views(out), layout.kv_views(block), strict=True):
            assert torch.equal(k_out, k_in) and torch.equal(v_out, v_in)

    last = layout.layers - 1
    for selector in (0, last // 2, last, range(1, min(3, layout.layers))):
        selected = layout.layer_range(selector)
        offset, nbytes = layout.span(selected)
        outs = [layout.empty(layers=len(selected)) for _ in blocks]
        futures = tier.get_layers(list(blocks), selector, outs)
        for future, out, block in zip(futures, outs, blocks.values(), strict=True):
            read = future.result(timeout=60)
            assert read.layers == selected and read.nbytes == nbytes
            assert torch.equal(out, block[offset : offset + nbytes])

    assert tier.delete(key(1)) and not tier.delete(key(1))
    with pytest.raises(BlockMissing):
        tier.get(key(1), layout.empty())
    [missing] = tier.get_layers([key(1)], 0, [layout.empty(layers=1)])
    with pytest.raises(BlockMissing):
        missing.result(timeout=60)
    assert tier.usage().blocks == 1


@pytest.mark.parametrize("kind", TIERS)
def test_unaligned_and_reused_buffers(kind: str, open_tier, block_cache) -> None:
    """Destinations need not be 4 KiB-aligned (the disk tier then uses buffered I/O)."""
    layout = layout_of(SMALL, "float16")
    tier = open_tier(kind, layout, blocks=2)
    block = block_cache(layout, 5)
    tier.put(key(5), block[:])
    raw = aligned_empty(layout.block_bytes + 64)
    out = raw[8 : 8 + layout.block_bytes]
    for _ in range(2):
        out.zero_()
        tier.get(key(5), out)
        assert torch.equal(out, block)
    layer_raw = aligned_empty(layout.layer_bytes + 64)
    layer_out = layer_raw[16 : 16 + layout.layer_bytes]
    tier.get_layers([key(5)], 3, [layer_out])[0].result(timeout=60)
    assert torch.equal(layer_out, block[3 * layout.layer_bytes : 4 * layout.layer_bytes])
    # A typed (bf16/fp16) destination works as well as bytes.
    typed = torch.empty(layout.block_bytes // 2, dtype=torch.float16)
    tier.get(key(5), typed)
    assert torch.equal(typed.view(torch.uint8), block)


@pytest.mark.parametrize("kind", TIERS)
def test_overwrite_replaces_the_block(kind: str, open_tier, block_cache) -> None:
    layout = layout_of(SMALL)
    tier = open_tier(kind, layout, blocks=3)
    tier.put(key(1), block_cache(layout, 1))
    tier.put(key(1), block_cache(layout, 2))
    out = layout.empty()
    tier.get(key(1), out)
    assert torch.equal(out, block_cache(layout, 2))
    usage = tier.usage()
    assert usage.blocks == 1
    assert usage.pending_bytes == 0


@pytest.mark.parametrize("kind", TIERS)
def test_wrong_sizes_are_refused(kind: str, open_tier) -> None:
    layout = layout_of(SMALL)
    tier = open_tier(kind, layout, blocks=2)
    with pytest.raises(ValueError):
        tier.put(key(1), torch.zeros(layout.block_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        tier.get_layers([key(1)], 0, [torch.empty(layout.layer_bytes * 2, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        tier.get_layers([key(1), key(2)], 0, [layout.empty(layers=1)])
    assert tier.usage().blocks == 0


@pytest.mark.parametrize("shape", [LLAMA, SMALL], ids=["llama", "small"])
@pytest.mark.parametrize("kind", TIERS)
def test_batched_puts_and_gets(kind: str, shape: dict, open_tier, block_cache, hasher) -> None:
    """put_many / get_many: each block succeeds or fails on its own; what fits is exact."""
    layout = layout_of(shape, "bfloat16")
    tier = open_tier(kind, layout, blocks=3)
    if kind in ("disk", "remote"):  # size the quota to exactly three blocks
        tier.capacity_bytes = 3 * (tier.file_bytes if kind == "disk" else tier.value_bytes)
    blocks = [block_cache(layout, n) for n in range(4)]
    given = hasher.checksum(key(0), blocks[0], layout)
    futures = tier.put_many([(key(n), blocks[n]) for n in range(4)], checksums=[given, None, None, None])
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(timeout=120))
        except TierFull:
            outcomes.append(None)
    assert sum(o is None for o in outcomes) == 1, outcomes  # exactly one block did not fit
    if kind != "device":
        assert outcomes[0] is None or outcomes[0].checksum == given
    stored = [n for n, o in enumerate(outcomes) if o is not None]
    assert tier.usage().blocks == 3 and tier.usage().pending_bytes == 0
    outs = [layout.empty() for _ in stored]
    reads = tier.get_many([key(n) for n in stored], outs)
    for n, out, future in zip(stored, outs, reads, strict=True):
        read = future.result(timeout=120)
        assert read.layers == range(layout.layers)
        assert torch.equal(out, blocks[n])
