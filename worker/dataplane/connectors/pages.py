"""An engine's paged KV cache seen as Strata blocks: the page layouts we read and write, and the
gather and scatter between a request's pages and our 256-token, layer-major blocks.

A page holds `page_tokens` tokens of one layer (vLLM's block_size: 16-128); a Strata block holds
`block_tokens` tokens of every layer, per layer K then V as [tokens, kv_heads, head_dim]. A block
spans block_tokens / page_tokens pages. Each layer's tensor is read through two views of logical
shape [pages, page_tokens, kv_heads, head_dim], one for K and one for V; a copy between a run of
consecutive pages and the tokens of a block is one strided copy, so a gather or a scatter moves
each byte once. (Per-page index copies into a strided view are far slower than a copy per run
of pages, which goes at memcpy speed; benchmarks/README.md.)

The layouts, by the attention backend that owns the tensor (vLLM 0.32's per-layer views):

    rows   CPU_ATTN: [pages, kv_heads, page_tokens, 2 * head_dim], which its kernels read as
           [pages, kv_heads, 2 * page_tokens, head_dim]: per head, the page's K rows, then its V rows.
    split  FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: logical [pages, kv_heads, page_tokens,
           2 * head_dim] in any physical stride order: each token's K, then its V, on the last axis.

Any other backend (MLA's latent cache, FlashInfer's, a quantized cache) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.dataplane.buffers import runs
from worker.dataplane.layout import BlockLayout, dtype_name

BACKEND_LAYOUTS: dict[str, str] = {
    "CPU_ATTN": "rows",
    "FLASH_ATTN": "split",
    "TRITON_ATTN": "split",
    "FLEX_ATTENTION": "split",
}
"""The attention backends whose KV tensors Strata reads and writes, and their layout."""


class UnsupportedLayout(ValueError):
    """The engine's KV cache is laid out in a way Strata does not read; the message says how."""


def layout_of(backend: str) -> str:
    """The page layout of an attention backend (by its vLLM name), or UnsupportedLayout."""
    try:
        return BACKEND_LAYOUTS[backend]
    except KeyError:
        raise UnsupportedLayout(
            f"attention backend {backend}: Strata reads the KV caches of {', '.join(sorted(BACKEND_LAYOUTS))} "
            f"only (choose one with --attention-backend)"
        ) from None


def page_views(kind: str, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every page of one layer's tensor, as [pages, page_tokens, kv_heads, head_dim] views."""
    if layer.dim() != 4 or layer.shape[3] % 2:
        raise UnsupportedLayout(
            f"a layer's KV tensor must be [pages, kv_heads, page_tokens, 2 * head_dim], got {list(layer.shape)}"
        )
    pages, heads, tokens, both = layer.shape
    head_dim = both // 2
    if kind == "rows":
        if not layer.is_contiguous():
            raise UnsupportedLayout("a CPU_ATTN layer's KV tensor must be contiguous")
        rows = layer.view(pages, heads, 2 * tokens, head_dim)
        return rows[:, :, :tokens].permute(0, 2, 1, 3), rows[:, :, tokens:].permute(0, 2, 1, 3)
    if kind == "split":
        return layer[..., :head_dim].permute(0, 2, 1, 3), layer[..., head_dim:].permute(0, 2, 1, 3)
    raise UnsupportedLayout(
        f"unknown page layout {kind!r}; expected one of {', '.join(sorted(set(BACKEND_LAYOUTS.values())))}"
    )


class PagedKV:
    """The paged KV tensors of every layer of one engine, and the copies between them and blocks.

    A request's pages are the list `pages`: pages[i] holds its tokens [i * page_tokens,
    (i + 1) * page_tokens)."""

    def __init__(self, layers: Sequence[torch.Tensor], *, kind: str, layout: BlockLayout) -> None:
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
        the engine has already)."""
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
        for dst, src in ((self.k[layer], blocks[:, 0]), (self.v[layer], blocks[:, 1])):
            tokens = src.reshape(-1, heads, dim)[offset : offset + count]
            for page, at, length in runs(pages[first_page : first_page + full]):
                dst[page : page + length].copy_(tokens[at * n : (at + length) * n].view(length, n, heads, dim))
            if count > full * n:
                dst[pages[first_page + full], : count - full * n].copy_(tokens[full * n :])

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
        heads, dim = self.layout.kv_heads, self.layout.head_dim
        for dst, src in ((k_dst, self.k[layer]), (v_dst, self.v[layer])):
            for page, at, count in runs(pages[index * per : (index + 1) * per]):
                dst[at * n : (at + count) * n].view(count, n, heads, dim).copy_(
                    src[page : page + count], non_blocking=non_blocking
                )
