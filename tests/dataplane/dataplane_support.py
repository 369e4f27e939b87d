"""Shared constants and helpers of the data-plane tests (imported by the test modules)."""

from __future__ import annotations

import uuid

import torch

from worker.dataplane.layout import BlockLayout

LLAMA = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_tokens": 256}
SMALL = {"layers": 8, "kv_heads": 4, "head_dim": 64, "block_tokens": 256}
ODD = {"layers": 3, "kv_heads": 2, "head_dim": 8, "block_tokens": 5}
"""A layout whose layers are not 4 KiB multiples, to drive the unaligned (buffered) I/O paths."""

DTYPES = ("float32", "float16", "bfloat16")


def layout_of(shape: dict[str, int], dtype: str = "bfloat16") -> BlockLayout:
    return BlockLayout(dtype=dtype, **shape)


def make_block(layout: BlockLayout, *, seed: int) -> torch.Tensor:
    """A block of random K/V values of the layout's dtype, as aligned bytes."""
    generator = torch.Generator().manual_seed(seed)
    kv = [
        (
            torch.randn(layout.kv_shape, generator=generator).to(layout.dtype),
            torch.randn(layout.kv_shape, generator=generator).to(layout.dtype),
        )
        for _ in range(layout.layers)
    ]
    return layout.pack(kv)


def key(n: int) -> uuid.UUID:
    return uuid.UUID(int=0x5717A000_0000_0000_0000_0000_0000_0000 + n)
