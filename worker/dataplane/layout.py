"""Byte layout of a KV block: sizes, per-layer K/V offsets and zero-copy views, from a model profile.

`ModelProfile` lives in the torch-free `profile` module and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from worker.dataplane.buffers import aligned_empty, tensor_bytes
from worker.dataplane.profile import DTYPE_ALIASES, KV_DTYPES, ModelProfile
from worker.dataplane.profile import positive_int as _positive_int

__all__ = ["DTYPE_CODES", "BlockLayout", "ModelProfile", "dtype_name", "parse_dtype"]

_DTYPES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_ALIASES.items()}
_DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, name): name for name in KV_DTYPES}
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
"""Stable small integers for dtypes, written into block headers."""


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A supported KV dtype from its torch object or a name such as 'bf16' or 'float16'."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {value}; expected float32, float16 or bfloat16")
        return value
    name = str(value).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {value!r}; expected float32, float16 or bfloat16")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[parse_dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Where each byte of a block lives: layer-major, for each layer K then V, each
    ``[block_tokens, kv_heads, head_dim]`` in ``dtype``. A layer's slice has a fixed offset,
    so every tier can read a single layer (pread at an offset, Redis GETRANGE)."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @functools.cached_property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def kv_shape(self) -> tuple[int, int, int]:
        return (self.block_tokens, self.kv_heads, self.head_dim)

    @functools.cached_property
    def kv_bytes(self) -> int:
        """Bytes of one K (or one V) of one layer."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.itemsize

    @functools.cached_property
    def layer_bytes(self) -> int:
        return 2 * self.kv_bytes

    @functools.cached_property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def layer_range(self, layers: int | range | slice | None = None) -> range:
        """Normalise a layer selector (one index, a range or a slice; None = all) to a
        non-empty contiguous range inside the block."""
        if layers is None:
            return range(self.layers)
        if isinstance(layers, int) and not isinstance(layers, bool):
            if not 0 <= layers < self.layers:
                raise ValueError(f"layer {layers} is outside 0..{self.layers - 1}")
            return range(layers, layers + 1)
        if isinstance(layers, slice):
            layers = range(self.layers)[layers]
        if not isinstance(layers, range):
            raise TypeError(f"layers must be an int, range or slice, got {type(layers).__name__}")
        if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > self.layers:
            raise ValueError(f"layers must be a non-empty contiguous range inside 0..{self.layers}, got {layers}")
        return layers

    def layer_offset(self, layer: int) -> int:
        return self.layer_range(layer).start * self.layer_bytes

    def k_offset(self, layer: int) -> int:
        return self.layer_offset(layer)

    def v_offset(self, layer: int) -> int:
        return self.layer_offset(layer) + self.kv_bytes

    def span(self, layers: int | range | slice | None = None) -> tuple[int, int]:
        """(byte offset, byte count) of a contiguous run of layers inside the block."""
        selected = self.layer_range(layers)
        return selected.start * self.layer_bytes, len(selected) * self.layer_bytes

    def empty(
        self,
        *,
        layers: int | None = None,
        device: torch.device | str | None = None,
        pin: bool = False,
    ) -> torch.Tensor:
        """An aligned uint8 buffer for a whole block, or for `layers` layers of one."""
        count = self.layers if layers is None else _positive_int("layers", layers)
        return aligned_empty(count * self.layer_bytes, device=device, pin=pin)

    def kv_views(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero-copy (K, V) tensors for every layer held in `buffer` (a whole block, or the bytes
        of a run of layers as read by a layer-range get), each of shape `kv_shape`."""
        data = tensor_bytes(buffer)
        if data.numel() == 0 or data.numel() % self.layer_bytes:
            raise ValueError(f"buffer of {data.numel()} bytes is not a whole number of {self.layer_bytes}-byte layers")
        count = data.numel() // self.layer_bytes
        if data.data_ptr() % self.itemsize:
            raise ValueError(f"buffer address is not aligned to {self.itemsize} bytes for {self.dtype}")
        typed = data.view(self.dtype).view(count, 2, *self.kv_shape)
        return [(typed[layer, 0], typed[layer, 1]) for layer in range(count)]

    def pack(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Block bytes from per-layer (K, V) tensors (one copy; the engine produces them apart)."""
        if len(kv) != self.layers:
            raise ValueError(f"expected {self.layers} layers of (K, V), got {len(kv)}")
        block = self.empty(device=kv[0][0].device) if out is None else tensor_bytes(out)
        if block.numel() != self.block_bytes:
            raise ValueError(f"out holds {block.numel()} bytes, a block is {self.block_bytes}")
        for (k_dst, v_dst), (k, v) in zip(self.kv_views(block), kv, strict=True):
            if tuple(k.shape) != self.kv_shape or tuple(v.shape) != self.kv_shape:
                raise ValueError(f"K and V must have shape {self.kv_shape}, got {tuple(k.shape)} and {tuple(v.shape)}")
            k_dst.copy_(k)
            v_dst.copy_(v)
        return block

    def describe(self) -> str:
        return (
            f"{self.layers} layers x {self.kv_heads} kv heads x {self.head_dim} head dim x "
            f"{self.block_tokens} tokens, {dtype_name(self.dtype)} = {self.block_bytes} bytes"
        )


@functools.cache
def block_layout(profile: ModelProfile) -> BlockLayout:
    """The byte layout of a model's blocks, from its profile (one object per profile)."""
    return BlockLayout(
        layers=profile.layers,
        kv_heads=profile.kv_heads,
        head_dim=profile.head_dim,
        block_tokens=profile.block_tokens,
        dtype=parse_dtype(profile.dtype),
    )
