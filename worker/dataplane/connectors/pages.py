"""An engine's paged KV cache seen as Strata blocks: the page layouts we read and write, and the
gather and scatter between a request's pages and our 256-token, layer-major blocks.

A page holds `page_tokens` tokens of one layer (vLLM's block_size: 16-128); a Strata block holds
`block_tokens` tokens of every layer, per layer K then V as [tokens, kv_heads, head_dim], the one
layout every tier, engine and backend shares. A block spans block_tokens / page_tokens pages.
Each layer's tensor is read through two views, one for K and one for V, whose first axis is the
page and whose other axes name each element by token, head and dimension however the backend's
kernels lay them out; a copy between a run of consecutive pages and the tokens of a block is one
strided copy, so a gather or a scatter moves each byte once. (Per-page index copies into a
strided view are far slower than a copy per run of pages; benchmarks/README.md.) The CPU
layouts' runs are copied by the native routine (worker/dataplane/native/kvpages.c) where it is
built: their K is a transpose per page and head, which torch's strided copy moves one element at
a time.

The layouts, by the attention backend that owns the tensor and, on the CPU, the instruction set
its kernels were chosen for (vLLM 0.32's per-layer tensor is [pages, kv_heads, page_tokens,
2 * head_dim]; what its kernels keep there, per page and head, is below):

    cpu-vec  CPU_ATTN, ISA vec or vec16: K as [head_dim, page_tokens] (a token's K is a column),
             then V as [page_tokens, head_dim].
    cpu-amx  CPU_ATTN, ISA amx (bfloat16): K in groups of 16 tokens, each [head_dim / 2, 16, 2]
             (pairs of dimensions packed per token), then V in [head_dim / 16, page_tokens / 2,
             16, 2] (pairs of tokens packed per dimension).
    split    FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: logical [pages, kv_heads, page_tokens,
             2 * head_dim] in any physical stride order: each token's K, then its V, on the last axis.

Any other backend or CPU instruction set (MLA's latent cache, FlashInfer's, a quantized cache,
NEON, VSX, RVV) is refused by name: a layout read wrongly is a layout whose whole pages still
round-trip, so nothing short of reading each token where the kernel put it is exact (a partial
page, or a block shared with another engine, would hold other bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.dataplane import native
from worker.dataplane.buffers import runs
from worker.dataplane.layout import BlockLayout, dtype_name

BACKEND_LAYOUTS: dict[str, str] = {
    "FLASH_ATTN": "split",
    "TRITON_ATTN": "split",
    "FLEX_ATTENTION": "split",
}
"""The GPU attention backends whose KV tensors Strata reads and writes, and their layout."""
CPU_ISA_LAYOUTS: dict[str, str] = {"vec": "cpu-vec", "vec16": "cpu-vec", "amx": "cpu-amx"}
"""vLLM's CPU attention (CPU_ATTN): the instruction sets whose page layout Strata reads, and it."""
LAYOUTS = ("cpu-vec", "cpu-amx", "split")


class UnsupportedLayout(ValueError):
    """The engine's KV cache is laid out in a way Strata does not read; the message says how."""


def layout_of(backend: str, isa: str | None = None) -> str:
    """The page layout of an attention backend (by its vLLM name; for CPU_ATTN, by the instruction
    set vLLM chose for its kernels), or UnsupportedLayout."""
    if backend == "CPU_ATTN":
        if isa not in CPU_ISA_LAYOUTS:
            raise UnsupportedLayout(
                f"attention backend CPU_ATTN with its kernels for {isa or 'an unknown instruction set'}: Strata "
                f"reads the pages of {', '.join(sorted(CPU_ISA_LAYOUTS))} only"
            )
        return CPU_ISA_LAYOUTS[isa]
    try:
        return BACKEND_LAYOUTS[backend]
    except KeyError:
        raise UnsupportedLayout(
            f"attention backend {backend}: Strata reads the KV caches of CPU_ATTN, "
            f"{', '.join(sorted(BACKEND_LAYOUTS))} only (choose one with --attention-backend)"
        ) from None


def page_views(kind: str, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every page of one layer's tensor, as views whose first axis is the page and
    whose others are `token_view`'s of one page's [page_tokens, kv_heads, head_dim]."""
    if layer.dim() != 4 or layer.shape[3] % 2:
        raise UnsupportedLayout(
            f"a layer's KV tensor must be [pages, kv_heads, page_tokens, 2 * head_dim], got {list(layer.shape)}"
        )
    pages, heads, tokens, both = layer.shape
    dim = both // 2
    if kind == "split":
        return layer[..., :dim].permute(0, 2, 1, 3), layer[..., dim:].permute(0, 2, 1, 3)
    if kind not in LAYOUTS:
        raise UnsupportedLayout(f"unknown page layout {kind!r}; expected one of {', '.join(LAYOUTS)}")
    if not layer.is_contiguous():
        raise UnsupportedLayout("a CPU_ATTN layer's KV tensor must be contiguous")
    halves = layer.view(pages, heads, 2, tokens * dim)
    k, v = halves[:, :, 0], halves[:, :, 1]
    if kind == "cpu-vec":
        return (
            k.view(pages, heads, dim, tokens).permute(0, 3, 1, 2),
            v.view(pages, heads, tokens, dim).permute(0, 2, 1, 3),
        )
    if tokens % 16 or dim % 16:
        raise UnsupportedLayout(
            f"CPU_ATTN's amx pages need page_tokens and head_dim in multiples of 16, got {tokens} and {dim}"
        )
    return (
        k.view(pages, heads, tokens // 16, dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5),
        v.view(pages, heads, dim // 16, tokens // 2, 16, 2).permute(0, 3, 5, 1, 2, 4),
    )


def token_view(kind: str, part: str, tokens: torch.Tensor, pages: int) -> torch.Tensor:
    """`tokens` ([pages * page_tokens, kv_heads, head_dim], whole pages) viewed as `page_views`'
    views of `pages` pages of `part` ("k" or "v")."""
    count, heads, dim = tokens.shape
    n = count // pages
    if kind != "cpu-amx":
        return tokens.view(pages, n, heads, dim)
    if part == "k":
        return tokens.view(pages, n // 16, 16, heads, dim // 2, 2)
    return tokens.view(pages, n // 2, 2, heads, dim // 16, 16)


class PagedKV:
    """The paged KV tensors of every layer of one engine, and the copies between them and blocks.

    A request's pages are the list `pages`: pages[i] holds its tokens [i * page_tokens,
    (i + 1) * page_tokens)."""

    def __init__(
        self, layers: Sequence[torch.Tensor], *, kind: str, layout: BlockLayout, native_copy: bool = True
    ) -> None:
        if len(layers) != layout.layers:
            raise UnsupportedLayout(
                f"the engine has {len(layers)} attention layers with a KV cache, the model profile {layout.layers}"
            )
        first = layers[0]
        pages, heads, tokens, both = first.shape if first.dim() == 4 else (0, 0, 0, 0)
        for index, tensor in enumerate(layers):
            if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
                raise UnsupportedLayout(
                    f"layer {index}'s KV tensor is {list(tensor.shape)} {tensor.dtype} on "
                    f"{tensor.device}, layer 0's {list(first.shape)} {first.dtype} on {first.device}"
                )
        if (heads, both // 2) != (layout.kv_heads, layout.head_dim):
            raise UnsupportedLayout(
                f"the engine's pages hold {heads} kv heads x {both // 2} head dim, the model "
                f"profile {layout.kv_heads} x {layout.head_dim}"
            )
        if first.dtype != layout.dtype:
            raise UnsupportedLayout(
                f"the engine's KV cache is {first.dtype}, the model profile "
                f"{dtype_name(layout.dtype)} (a quantized KV cache is not read)"
            )
        if tokens <= 0 or layout.block_tokens % tokens:
            raise UnsupportedLayout(
                f"a page of {tokens} tokens does not divide a block of {layout.block_tokens}: "
                f"set the engine's block size to a divisor of {layout.block_tokens}"
            )
        self.kind = kind
        self.layout = layout
        self.pages = pages
        self.page_tokens = tokens
        self.pages_per_block = layout.block_tokens // tokens
        self.device = first.device
        views = [page_views(kind, tensor) for tensor in layers]
        self.k = [k for k, _ in views]
        self.v = [v for _, v in views]
        # CPU pages are copied by the native routine where it is built (kvpages.c) and
        # `native_copy` allows: a page's transpose or interleave per head runs along its contiguous
        # sides, faster than torch's element-wise strided copy (benchmarks/README.md); elsewhere,
        # and on a GPU, by torch.
        self._native = native_copy and kind in native.KV_LAYOUTS and first.device.type == "cpu" and native.available()
        self._addresses = [tensor.data_ptr() for tensor in layers]
        self._elem = first.element_size()
        self._page_bytes = heads * tokens * both * self._elem
        row = heads * (both // 2) * self._elem
        self._block_geometry = self._geometry(layout.block_tokens, layout.block_tokens * row, row)
        """A whole block's bytes as `layout.kv_views` gives them: where gathers write."""

    def _geometry(self, block_tokens: int, block_stride: int, token_stride: int) -> native.KvGeometry:
        return native.KvGeometry(
            elem=self._elem,
            heads=self.layout.kv_heads,
            dim=self.layout.head_dim,
            page_tokens=self.page_tokens,
            page_stride=self._page_bytes,
            head_stride=self.page_tokens * 2 * self.layout.head_dim * self._elem,
            block_tokens=block_tokens,
            block_stride=block_stride,
            token_stride=token_stride,
        )

    def _copy_natively(
        self,
        layer: int,
        parts: Sequence[tuple[str, int]],
        geometry: native.KvGeometry,
        *,
        to_pages: bool,
        pages: Sequence[int],
        skip: int,
        count: int,
    ) -> bool:
        """`count` tokens between `pages` (the first holds the first of them) and tokens [skip,
        skip + count) of the block side, for each (part, address of the block side's token 0) of
        `parts`, natively; False, having copied nothing, where the library is not loaded."""
        n = self.page_tokens
        v_offset = n * self.layout.head_dim * self._elem
        for part, tokens in parts:
            for page, at, length in runs(pages[: -(-count // n)]):
                address = self._addresses[layer] + page * self._page_bytes + (0 if part == "k" else v_offset)
                copied = native.kv_pages(
                    self.kind,
                    part,
                    to_pages=to_pages,
                    geometry=geometry,
                    pages=address,
                    tokens=tokens,
                    skip=skip + at * n,
                    count=min(length * n, count - at * n),
                )
                if not copied:
                    return False
        return True

    def token(self, part: str, layer: int, page: int, token: int) -> torch.Tensor:
        """K or V (`part`) of one token of one page of one layer, [kv_heads, head_dim]: a view of
        the page's memory where the backend's kernels keep it."""
        view = (self.k if part == "k" else self.v)[layer][page]
        if self.kind != "cpu-amx":
            return view[token]
        group = 16 if part == "k" else 2
        return view[token // group, token % group].reshape(self.layout.kv_heads, self.layout.head_dim)

    def _check(self, pages: Sequence[int], upto: int) -> None:
        needed = -(-upto // self.page_tokens)
        if len(pages) < needed:
            raise ValueError(f"{upto} tokens need {needed} pages, the request has {len(pages)}")

    def scatter(
        self, layer: int, blocks: torch.Tensor, *, first_block: int, start: int, end: int, pages: Sequence[int]
    ) -> None:
        """Write tokens [start, end) of a request into its pages, for one layer. `blocks` holds
        that layer of the request's blocks from `first_block` on ([n, 2, block_tokens, kv_heads,
        head_dim], K then V); `start` is a multiple of page_tokens (pages before it hold tokens
        the engine has already). Where `end` falls inside a page, only that page's first tokens
        are written: the engine writes the others (it computes them in the same step, before the
        layer's attention waits for this load)."""
        size, n = self.layout.block_tokens, self.page_tokens
        if start % n or not first_block * size <= start <= end <= (first_block + blocks.shape[0]) * size:
            raise ValueError(
                f"tokens {start}..{end} do not lie on pages inside blocks {first_block}.."
                f"{first_block + blocks.shape[0]}"
            )
        self._check(pages, end)
        heads, dim = self.layout.kv_heads, self.layout.head_dim
        offset = start - first_block * size
        count = end - start
        full = count // n
        first_page = start // n
        if self._native and self._scatter_natively(layer, blocks, pages[first_page:], offset, count):
            return
        for part, dst, src in (("k", self.k[layer], blocks[:, 0]), ("v", self.v[layer], blocks[:, 1])):
            tokens = src.reshape(-1, heads, dim)[offset : offset + count]
            for page, at, length in runs(pages[first_page : first_page + full]):
                dst[page : page + length].copy_(token_view(self.kind, part, tokens[at * n : (at + length) * n], length))
            if count > full * n:
                self._head_of_page(part, dst[pages[first_page + full]], tokens[full * n :])

    def _scatter_natively(self, layer: int, blocks: torch.Tensor, pages: Sequence[int], skip: int, count: int) -> bool:
        """scatter's copies by the native routine: tokens [skip, skip + count) of `blocks` into
        `pages` (the first holds token `skip`); False, having copied nothing, where it cannot."""
        heads, dim = self.layout.kv_heads, self.layout.head_dim
        rows = (heads * dim, dim, 1)
        if blocks.dtype != self.layout.dtype or blocks.device.type != "cpu" or blocks.stride()[2:] != rows:
            return False
        geometry = self._geometry(blocks.shape[2], blocks.stride(0) * self._elem, heads * dim * self._elem)
        parts = (("k", blocks[:, 0].data_ptr()), ("v", blocks[:, 1].data_ptr()))
        return self._copy_natively(layer, parts, geometry, to_pages=True, pages=pages, skip=skip, count=count)

    def _head_of_page(self, part: str, page: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write `tokens` ([r, kv_heads, head_dim], fewer than a page) as the first r tokens of
        `page` (one page of `part`'s view), leaving the others as they are: whole groups of the
        tokens the layout packs together, then the first tokens of the group they end in."""
        if self.kind != "cpu-amx":
            page[: len(tokens)].copy_(tokens)
            return
        group = 16 if part == "k" else 2
        whole, rest = divmod(len(tokens), group)
        if whole:
            page[:whole].copy_(token_view(self.kind, part, tokens[: whole * group], 1)[0])
        if rest:
            heads, dim = tokens.shape[1:]
            inner = (dim // 2, 2) if part == "k" else (dim // 16, 16)
            page[whole, :rest].copy_(tokens[whole * group :].reshape(rest, heads, *inner))

    def gather(self, block: torch.Tensor, *, index: int, pages: Sequence[int]) -> None:
        """Copy block `index` of a request (its tokens [index * block_tokens, (index + 1) *
        block_tokens)) from its pages into `block`, a whole block's bytes in our layout."""
        for layer, (k_dst, v_dst) in enumerate(self.layout.kv_views(block)):
            self.gather_layer(layer, k_dst, v_dst, index=index, pages=pages)

    def gather_layer(
        self,
        layer: int,
        k_dst: torch.Tensor,
        v_dst: torch.Tensor,
        *,
        index: int,
        pages: Sequence[int],
        non_blocking: bool = False,
    ) -> None:
        """One layer of block `index` into K and V ([block_tokens, kv_heads, head_dim]); with
        `non_blocking`, a device-to-pinned-host copy queued on the current stream."""
        per, n = self.pages_per_block, self.page_tokens
        self._check(pages, (index + 1) * self.layout.block_tokens)
        if self._native and self._gather_natively(layer, k_dst, v_dst, pages[index * per : (index + 1) * per]):
            return
        for part, dst, src in (("k", k_dst, self.k[layer]), ("v", v_dst, self.v[layer])):
            for page, at, count in runs(pages[index * per : (index + 1) * per]):
                token_view(self.kind, part, dst[at * n : (at + count) * n], count).copy_(
                    src[page : page + count], non_blocking=non_blocking
                )

    def _gather_natively(self, layer: int, k_dst: torch.Tensor, v_dst: torch.Tensor, pages: Sequence[int]) -> bool:
        """gather_layer's copies by the native routine; False, having copied nothing, where it cannot."""
        for dst in (k_dst, v_dst):
            if dst.dtype != self.layout.dtype or dst.device.type != "cpu" or not dst.is_contiguous():
                return False
        parts = (("k", k_dst.data_ptr()), ("v", v_dst.data_ptr()))
        return self._copy_natively(
            layer, parts, self._block_geometry, to_pages=False, pages=pages, skip=0, count=len(pages) * self.page_tokens
        )
