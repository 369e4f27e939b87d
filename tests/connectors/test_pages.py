"""Gather and scatter between an engine's pages and Strata blocks, for every layout the connector
reads (vLLM's CPU rows layout and the CUDA backends' split layout, laid out on the CPU here), and
the layouts it refuses by name."""

from __future__ import annotations

import pytest
import torch

from worker.dataplane.buffers import runs
from worker.dataplane.connectors.pages import PagedKV, UnsupportedLayout, layout_of
from worker.dataplane.layout import BlockLayout

LAYOUT = BlockLayout(layers=3, kv_heads=2, head_dim=8, block_tokens=32, dtype=torch.float32)
PAGE = 8


def rows_layers(pages: int) -> list[torch.Tensor]:
    """CPU_ATTN: [pages, heads, page_tokens, 2 * head_dim], read as K rows then V rows per head."""
    return [torch.zeros(pages, LAYOUT.kv_heads, PAGE, 2 * LAYOUT.head_dim) for _ in range(LAYOUT.layers)]


def split_layers(pages: int) -> list[torch.Tensor]:
    """FLASH_ATTN-style: logical [pages, heads, page_tokens, 2 * head_dim] stored token-major
    ([pages, page_tokens, heads, 2 * head_dim] physically), as vLLM's NHD stride order does."""
    return [
        torch.zeros(pages, PAGE, LAYOUT.kv_heads, 2 * LAYOUT.head_dim).permute(0, 2, 1, 3) for _ in range(LAYOUT.layers)
    ]


def kv_of(kind: str, tensor: torch.Tensor, page: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([heads, head_dim]) of one token of one page, read the way the backend's kernel does."""
    d = LAYOUT.head_dim
    if kind == "rows":
        rows = tensor.view(tensor.shape[0], LAYOUT.kv_heads, 2 * PAGE, d)
        return rows[page, :, token], rows[page, :, PAGE + token]
    return tensor[page, :, token, :d], tensor[page, :, token, d:]


def random_blocks(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(count):
        block = LAYOUT.empty()
        block.view(torch.float32).copy_(torch.randn(LAYOUT.block_bytes // 4, generator=generator))
        blocks.append(block)
    return blocks


@pytest.mark.parametrize("kind,make", [("rows", rows_layers), ("split", split_layers)])
def test_gather_then_scatter_round_trips_every_token(kind, make):
    layers = make(40)
    paged = PagedKV(layers, kind=kind, layout=LAYOUT)
    # A request's pages are rarely in order: two runs and a lone page per block.
    pages = [5, 6, 7, 20, 9, 10, 11, 30, 1, 2, 3, 4]
    blocks = random_blocks(3, seed=1)
    for layer in range(LAYOUT.layers):
        stacked = (
            torch.stack([LAYOUT.kv_views(b)[layer][0] for b in blocks]),
            torch.stack([LAYOUT.kv_views(b)[layer][1] for b in blocks]),
        )
        typed = torch.stack(stacked, dim=1)  # [blocks, 2, tokens, heads, dim], as the loader's buffers
        paged.scatter(layer, typed, first_block=0, start=0, end=3 * LAYOUT.block_tokens, pages=pages)
    # Every token sits where the kernel reads it.
    for index, block in enumerate(blocks):
        for layer, (k, v) in enumerate(LAYOUT.kv_views(block)):
            for token in (0, 7, 8, 31):
                t = index * LAYOUT.block_tokens + token
                page_k, page_v = kv_of(kind, layers[layer], pages[t // PAGE], t % PAGE)
                assert torch.equal(page_k, k[token]) and torch.equal(page_v, v[token])
    for index, block in enumerate(blocks):
        out = LAYOUT.empty()
        paged.gather(out, index=index, pages=pages)
        assert torch.equal(out, block)


@pytest.mark.parametrize("kind,make", [("rows", rows_layers), ("split", split_layers)])
def test_scatter_fills_only_the_tokens_asked(kind, make):
    layers = make(16)
    paged = PagedKV(layers, kind=kind, layout=LAYOUT)
    pages = list(range(16))
    (block_one, block_two) = random_blocks(2, seed=2)
    # The engine had tokens 0..15 already (two pages of its own cache); load 16..50 of blocks 0-1.
    for layer in range(LAYOUT.layers):
        typed = torch.stack([torch.stack(LAYOUT.kv_views(b)[layer]) for b in (block_one, block_two)])
        paged.scatter(layer, typed, first_block=0, start=16, end=51, pages=pages)
    for layer in range(LAYOUT.layers):
        k_page0, _ = kv_of(kind, layers[layer], 1, 7)
        assert not k_page0.any()  # token 15: the engine's own, untouched
        k, v = LAYOUT.kv_views(block_two)[layer]
        got_k, got_v = kv_of(kind, layers[layer], 50 // PAGE, 50 % PAGE)
        assert torch.equal(got_k, k[50 - 32]) and torch.equal(got_v, v[50 - 32])
        after, _ = kv_of(kind, layers[layer], 51 // PAGE, 51 % PAGE)
        assert not after.any()  # token 51: the last prompt token, computed by the engine


def test_scatter_refuses_a_range_off_the_pages():
    paged = PagedKV(rows_layers(8), kind="rows", layout=LAYOUT)
    typed = torch.zeros(1, 2, LAYOUT.block_tokens, LAYOUT.kv_heads, LAYOUT.head_dim)
    with pytest.raises(ValueError, match="do not lie on pages"):
        paged.scatter(0, typed, first_block=0, start=3, end=20, pages=list(range(8)))
    with pytest.raises(ValueError, match="need 5 pages, the request has 4"):
        paged.scatter(0, typed, first_block=1, start=32, end=40, pages=list(range(4)))


def test_layouts_it_cannot_read_are_refused_by_name():
    with pytest.raises(
        UnsupportedLayout,
        match="attention backend FLASHINFER: Strata reads the KV caches of "
        "CPU_ATTN, FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN only",
    ):
        layout_of("FLASHINFER")
    with pytest.raises(UnsupportedLayout, match="hold 4 kv heads x 8 head dim, the model profile 2 x 8"):
        PagedKV([torch.zeros(4, 4, PAGE, 16)] * 3, kind="rows", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="KV cache is torch.bfloat16, the model profile float32"):
        PagedKV([torch.zeros(4, 2, PAGE, 16, dtype=torch.bfloat16)] * 3, kind="rows", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="a page of 12 tokens does not divide a block of 32"):
        PagedKV([torch.zeros(4, 2, 12, 16)] * 3, kind="rows", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="2 attention layers with a KV cache, the model profile 3"):
        PagedKV([torch.zeros(4, 2, PAGE, 16)] * 2, kind="rows", layout=LAYOUT)


def test_page_runs_group_consecutive_pages():
    assert runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert runs([]) == []
