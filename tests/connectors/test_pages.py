"""Gather and scatter between an engine's pages and Strata blocks, for every layout the connector
reads: vLLM's CPU attention pages as its own kernel writes them (each instruction set this machine
runs), the CUDA backends' split layout (laid out on the CPU here); and the layouts it refuses by
name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.dataplane import native
from worker.dataplane.buffers import runs
from worker.dataplane.connectors.pages import PagedKV, UnsupportedLayout, layout_of
from worker.dataplane.layout import BlockLayout

LAYOUT = BlockLayout(layers=3, kv_heads=2, head_dim=8, block_tokens=32, dtype=torch.float32)
PAGE = 8


def cpu_layers(pages: int) -> list[torch.Tensor]:
    """CPU_ATTN: [pages, heads, page_tokens, 2 * head_dim] (K as [head_dim, page_tokens], then V
    as [page_tokens, head_dim], per page and head, for the vec kernels)."""
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
    if kind == "cpu-vec":
        halves = tensor.view(tensor.shape[0], LAYOUT.kv_heads, 2, PAGE * d)
        k = halves[page, :, 0].view(LAYOUT.kv_heads, d, PAGE)[:, :, token]
        return k, halves[page, :, 1].view(LAYOUT.kv_heads, PAGE, d)[:, token]
    return tensor[page, :, token, :d], tensor[page, :, token, d:]


def random_blocks(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(count):
        block = LAYOUT.empty()
        block.view(torch.float32).copy_(torch.randn(LAYOUT.block_bytes // 4, generator=generator))
        blocks.append(block)
    return blocks


@pytest.mark.parametrize("kind,make", [("cpu-vec", cpu_layers), ("split", split_layers)])
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


@pytest.mark.parametrize("kind,make", [("cpu-vec", cpu_layers), ("split", split_layers)])
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
    paged = PagedKV(cpu_layers(8), kind="cpu-vec", layout=LAYOUT)
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
    with pytest.raises(
        UnsupportedLayout, match="CPU_ATTN with its kernels for neon: Strata reads the pages of amx, vec"
    ):
        layout_of("CPU_ATTN", "neon")
    assert (layout_of("CPU_ATTN", "vec"), layout_of("CPU_ATTN", "vec16"), layout_of("CPU_ATTN", "amx")) == (
        "cpu-vec",
        "cpu-vec",
        "cpu-amx",
    )
    with pytest.raises(UnsupportedLayout, match="hold 4 kv heads x 8 head dim, the model profile 2 x 8"):
        PagedKV([torch.zeros(4, 4, PAGE, 16)] * 3, kind="cpu-vec", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="KV cache is torch.bfloat16, the model profile float32"):
        PagedKV([torch.zeros(4, 2, PAGE, 16, dtype=torch.bfloat16)] * 3, kind="cpu-vec", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="a page of 12 tokens does not divide a block of 32"):
        PagedKV([torch.zeros(4, 2, 12, 16)] * 3, kind="cpu-vec", layout=LAYOUT)
    with pytest.raises(UnsupportedLayout, match="2 attention layers with a KV cache, the model profile 3"):
        PagedKV([torch.zeros(4, 2, PAGE, 16)] * 2, kind="cpu-vec", layout=LAYOUT)


def test_page_runs_group_consecutive_pages():
    assert runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert runs([]) == []


# -- vLLM's CPU attention pages, written by its own kernel --------------------------------------------
def kernel_isas() -> list[Any]:
    """(isa, dtype, head_dim, page) of each CPU attention kernel vLLM would pick on this machine."""
    cases: list[Any] = [
        ("vec", torch.float32, 32, 32),
        ("vec", torch.bfloat16, 64, 16),
        ("vec16", torch.float32, 80, 16),
    ]
    amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX")
    cases.append(pytest.param("amx", torch.bfloat16, 32, 32, marks=amx))
    cases.append(pytest.param("amx", torch.bfloat16, 64, 64, marks=amx))
    return cases


COPIERS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not native.available(), reason="kvpages.c not built")),
    pytest.param(False, id="torch"),
]
"""Both ways the CPU pages are copied: the native routine (kvpages.c) and torch's strided copy."""


def kernel_write(layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[int], isa: str) -> None:
    """What vLLM's CPU attention does with a step's new tokens (`do_kv_cache_update`)."""
    import vllm._custom_ops  # noqa: F401 - loads the kernels

    pages, heads, page, _ = layer.shape
    key_cache, value_cache = layer.view(pages, heads, 2 * page, -1).chunk(2, dim=2)
    mapping = torch.tensor(slots, dtype=torch.int64)
    torch.ops._C.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, mapping, isa)


@pytest.mark.parametrize("native_copy", COPIERS)
@pytest.mark.parametrize(("isa", "dtype", "head_dim", "page"), kernel_isas())
def test_cpu_pages_are_read_where_vllm_s_kernel_writes_each_token(isa, dtype, head_dim, page, native_copy):
    """Tokens written by vLLM's own kernel, gathered into a block: each token's K and V where our
    layout keeps them; scattered back into other pages and gathered again: the same block, and a
    token the kernel then writes over lands on the token it names, nowhere else."""
    layout = BlockLayout(layers=2, kv_heads=2, head_dim=head_dim, block_tokens=2 * page, dtype=dtype)
    kind = layout_of("CPU_ATTN", isa)
    layers = [torch.zeros(8, 2, page, 2 * head_dim, dtype=dtype) for _ in range(layout.layers)]
    generator = torch.Generator().manual_seed(3)
    tokens = layout.block_tokens
    pages = [5, 2]  # the block's two pages, out of order
    slots = [pages[t // page] * page + t % page for t in range(tokens)]
    written = []
    for layer in layers:
        keys = torch.randn(tokens, 2, head_dim, generator=generator).to(dtype)
        values = torch.randn(tokens, 2, head_dim, generator=generator).to(dtype)
        kernel_write(layer, keys, values, slots, isa)
        written.append((keys, values))
    paged = PagedKV(layers, kind=kind, layout=layout, native_copy=native_copy)
    block = layout.empty()
    paged.gather(block, index=0, pages=pages)
    for (keys, values), (k, v) in zip(written, layout.kv_views(block), strict=True):
        assert torch.equal(k, keys) and torch.equal(v, values)
    other = [1, 6]
    for layer in range(layout.layers):
        typed = torch.stack(layout.kv_views(block)[layer]).unsqueeze(0)
        paged.scatter(layer, typed, first_block=0, start=0, end=tokens, pages=other)
    again = layout.empty()
    paged.gather(again, index=0, pages=other)
    assert torch.equal(again, block)
    one = page + 3  # a token of the second page
    new_k = torch.full((1, 2, head_dim), 7.0, dtype=dtype)
    kernel_write(layers[0], new_k, -new_k, [other[1] * page + 3], isa)
    changed = layout.empty()
    paged.gather(changed, index=0, pages=other)
    k0, v0 = layout.kv_views(changed)[0]
    assert torch.equal(k0[one], new_k[0]) and torch.equal(v0[one], -new_k[0])
    k_before, v_before = layout.kv_views(block)[0]
    rest = [t for t in range(tokens) if t != one]
    assert torch.equal(k0[rest], k_before[rest]) and torch.equal(v0[rest], v_before[rest])
    assert torch.equal(paged.token("k", 0, other[1], 3), new_k[0])


@pytest.mark.parametrize("native_copy", COPIERS)
@pytest.mark.parametrize(("isa", "dtype", "head_dim", "page"), kernel_isas())
@pytest.mark.parametrize("end", [3, 17, 30, 31])
def test_a_load_that_ends_inside_a_page_leaves_the_rest_to_the_engine(isa, dtype, head_dim, page, end, native_copy):
    """A hit that covers a prompt but its last token ends inside a page: the engine writes the
    tokens after the load's end (vLLM writes a step's new tokens before the layer's attention
    waits for the load), then the load writes its own. Every token ends where the kernel reads it."""
    end = min(end, page - 1)
    layout = BlockLayout(layers=1, kv_heads=2, head_dim=head_dim, block_tokens=page, dtype=dtype)
    layers = [torch.zeros(4, 2, page, 2 * head_dim, dtype=dtype)]
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(page, 2, head_dim, generator=generator).to(dtype)
    values = torch.randn(page, 2, head_dim, generator=generator).to(dtype)
    kernel_write(layers[0], keys[end:], values[end:], [2 * page + t for t in range(end, page)], isa)
    paged = PagedKV(layers, kind=layout_of("CPU_ATTN", isa), layout=layout, native_copy=native_copy)
    typed = torch.stack([keys, values]).unsqueeze(0)
    paged.scatter(0, typed, first_block=0, start=0, end=end, pages=[2])
    block = layout.empty()
    paged.gather(block, index=0, pages=[2])
    k, v = layout.kv_views(block)[0]
    assert torch.equal(k, keys) and torch.equal(v, values)


@pytest.mark.skipif(not native.available(), reason="kvpages.c not built")
@pytest.mark.parametrize(
    ("kind", "dtype", "head_dim", "page"),
    [("cpu-vec", torch.float32, 24, 8), ("cpu-vec", torch.bfloat16, 64, 16), ("cpu-amx", torch.bfloat16, 32, 16)],
)
def test_the_native_copy_moves_each_byte_where_torch_s_does(kind, dtype, head_dim, page):
    """Loads that start after the engine's own pages and end inside a page, from blocks held
    layer-major in a larger buffer (as the loader's are), into pages out of order; then saves:
    the native routine and torch's strided copy leave the same bytes everywhere."""
    layout = BlockLayout(layers=2, kv_heads=3, head_dim=head_dim, block_tokens=4 * page, dtype=dtype)
    generator = torch.Generator().manual_seed(11)
    buffer = torch.randn(4, layout.layers, 2, layout.block_tokens, 3, head_dim, generator=generator).to(dtype)
    pages = [9, 3, 4, 5, 12, 0, 1, 2, 7, 8, 10, 11, 13, 14, 15, 6]
    results = []
    for native_copy in (True, False):
        layers = [torch.full((16, 3, page, 2 * head_dim), -1.0, dtype=dtype) for _ in range(layout.layers)]
        paged = PagedKV(layers, kind=kind, layout=layout, native_copy=native_copy)
        for start, end in ((page, 3 * page + 5), (4 * page, 13 * page + 1), (13 * page, 15 * page + 3)):
            for layer in range(layout.layers):
                first = start // layout.block_tokens
                paged.scatter(layer, buffer[first:, layer], first_block=first, start=start, end=end, pages=pages)
        saved = [layout.empty() for _ in range(3)]
        for index, block in enumerate(saved):
            paged.gather(block, index=index, pages=pages)
        results.append((layers, saved))
    (native_layers, native_saved), (torch_layers, torch_saved) = results
    assert all(torch.equal(a, b) for a, b in zip(native_layers, torch_layers, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_saved, torch_saved, strict=True))


@pytest.mark.skipif(not native.available(), reason="kvpages.c not built")
def test_the_native_copy_refuses_a_geometry_its_layout_cannot_have_naming_it():
    """amx pages of float32 (amx packs bfloat16 pairs): refused by name, and nothing written."""
    pages = torch.zeros(2, 1, 32, 64)
    tokens = torch.ones(32, 1, 32)
    geometry = native.KvGeometry(
        elem=4, heads=1, dim=32, page_tokens=32, page_stride=pages[0].nbytes, head_stride=pages[0].nbytes,
        block_tokens=32, block_stride=tokens.nbytes, token_stride=32 * 4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="cpu-amx pages: no such geometry \\(4-byte elements, 32 tokens a page"):
        native.kv_pages(
            "cpu-amx", "k", to_pages=True, geometry=geometry, pages=pages.data_ptr(), tokens=tokens.data_ptr(),
            skip=0, count=32,
        )  # fmt: skip
    assert not pages.any()
