"""Block layout: sizes, offsets and zero-copy K/V views for every dtype."""

from __future__ import annotations

import pytest
import torch
from dataplane_support import DTYPES, LLAMA, SMALL, layout_of, make_block

from worker.dataplane.buffers import DIRECT_IO_ALIGNMENT, aligned_empty
from worker.dataplane.layout import BlockLayout, ModelProfile, block_layout


def test_llama3_8b_block_is_32_mib() -> None:
    layout = layout_of(LLAMA, "bfloat16")
    assert layout.kv_bytes == 256 * 8 * 128 * 2
    assert layout.layer_bytes == 1024 * 1024
    assert layout.block_bytes == 32 * 1024 * 1024


def test_layer_major_offsets_k_then_v() -> None:
    layout = layout_of(SMALL, "float16")
    for layer in range(layout.layers):
        assert layout.k_offset(layer) == layer * layout.layer_bytes
        assert layout.v_offset(layer) == layer * layout.layer_bytes + layout.kv_bytes
    assert layout.span(range(2, 5)) == (2 * layout.layer_bytes, 3 * layout.layer_bytes)
    assert layout.span(slice(-1, None)) == (
        (layout.layers - 1) * layout.layer_bytes,
        layout.layer_bytes,
    )
    assert layout.span(None) == (0, layout.block_bytes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [LLAMA, SMALL], ids=["llama", "small"])
def test_views_are_zero_copy_and_round_trip(shape: dict[str, int], dtype: str) -> None:
    layout = layout_of(shape, dtype)
    generator = torch.Generator().manual_seed(7)
    kv = [
        (
            torch.randn(layout.kv_shape, generator=generator).to(layout.dtype),
            torch.randn(layout.kv_shape, generator=generator).to(layout.dtype),
        )
        for _ in range(layout.layers)
    ]
    block = layout.pack(kv)
    assert block.dtype == torch.uint8 and block.numel() == layout.block_bytes
    views = layout.kv_views(block)
    for layer, ((k, v), (k0, v0)) in enumerate(zip(views, kv, strict=True)):
        assert k.dtype == layout.dtype and tuple(k.shape) == layout.kv_shape
        assert torch.equal(k, k0) and torch.equal(v, v0)
        # Zero-copy: the view's memory is the block's, at the documented offsets.
        assert k.data_ptr() == block.data_ptr() + layout.k_offset(layer)
        assert v.data_ptr() == block.data_ptr() + layout.v_offset(layer)
    views[3][1].fill_(0)
    offset = layout.v_offset(3)
    assert torch.count_nonzero(block[offset : offset + layout.kv_bytes]) == 0


def test_views_of_a_layer_range_buffer() -> None:
    layout = layout_of(SMALL, "bfloat16")
    block = make_block(layout, seed=3)
    offset, nbytes = layout.span(range(2, 4))
    part = layout.empty(layers=2)
    part.copy_(block[offset : offset + nbytes])
    (k2, v2), (k3, v3) = layout.kv_views(part)
    full = layout.kv_views(block)
    assert torch.equal(k2, full[2][0]) and torch.equal(v3, full[3][1])


def test_aligned_buffers() -> None:
    for nbytes in (1, 4096, 3 * 1024 * 1024 + 5):
        buffer = aligned_empty(nbytes)
        assert buffer.numel() == nbytes and buffer.data_ptr() % DIRECT_IO_ALIGNMENT == 0
    assert layout_of(SMALL).empty().data_ptr() % DIRECT_IO_ALIGNMENT == 0


def test_bad_layouts_and_selectors_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        BlockLayout(layers=1, kv_heads=1, head_dim=1, block_tokens=1, dtype="int8")
    with pytest.raises(ValueError, match="layers"):
        BlockLayout(layers=0, kv_heads=1, head_dim=1, block_tokens=1, dtype="fp16")
    layout = layout_of(SMALL)
    with pytest.raises(ValueError):
        layout.layer_range(layout.layers)
    with pytest.raises(ValueError):
        layout.layer_range(range(0, 4, 2))
    with pytest.raises(ValueError):
        layout.kv_views(torch.empty(layout.layer_bytes + 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        layout.kv_views(torch.empty(2, layout.block_bytes, dtype=torch.uint8)[:, :100])


def test_profile_gives_its_layout() -> None:
    profile = ModelProfile(model_id="meta-llama/Meta-Llama-3-8B", dtype="bf16", **LLAMA)
    assert profile.dtype == "bfloat16"
    assert block_layout(profile) == layout_of(LLAMA, "bfloat16")
