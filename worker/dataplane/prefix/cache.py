"""A transformers Cache whose layers start from a loaded prefix: each layer waits only for its own load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer

if TYPE_CHECKING:
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin


class LoadFailed(RuntimeError):
    """The prefix of a layer could not be loaded (a block vanished or failed its checksum)."""

    def __init__(self, layer: int, block_index: int, cause: BaseException) -> None:
        super().__init__(f"layer {layer}: block {block_index} could not be loaded: {cause}")
        self.layer = layer
        self.block_index = block_index
        self.cause = cause


class LoadDeadline(TimeoutError):
    """A load was still not in when its deadline passed (a tier that stopped answering)."""


class LayerGate:
    """The sync point of one layer: set by the loader once the layer's prefix is in place (on a
    GPU: once the copies that put it in place are queued, with the event that marks them done)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: LoadFailed | None = None
        self._cuda_event: Any = None
        self._device: torch.device | None = None
        self.loaded_at: float | None = None
        self.fill: Callable[[], None] | None = None
        """Loads the layer in the waiting thread and opens (or fails) the gate: set by a loader
        that has no thread of its own (see `LayerLoader(inline=True)`)."""
        self.deadline: float | None = None
        """When (perf_counter) a wait gives up on the layer; None: never."""
        self.expire: Callable[[], None] | None = None
        """Fails the gate (with LoadDeadline as the cause) once its deadline has passed: set by
        the loader with the deadline."""

    def open(self, *, cuda_event: Any = None, device: torch.device | None = None) -> None:
        """Let the layer compute; with `cuda_event` (recorded on the loader's stream on `device`)
        its attention runs once the event has fired, while the CPU goes on queueing work."""
        self._cuda_event = cuda_event
        self._device = device
        self.loaded_at = time.perf_counter()
        self._done.set()

    def fail(self, error: LoadFailed) -> None:
        self._error = error
        self.loaded_at = time.perf_counter()
        self._done.set()

    def is_set(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until this layer is loaded, or its deadline has passed (LoadFailed with a
        LoadDeadline cause); returns the seconds spent waiting (the stall)."""
        start = time.perf_counter()
        if self.fill is not None and not self._done.is_set():
            self.fill()
        remaining = None if self.deadline is None else max(0.0, self.deadline - start)
        if not self._done.wait(remaining) and self.expire is not None:
            self.expire()
        self._done.wait()
        stall = time.perf_counter() - start
        if self._error is not None:
            raise self._error
        if self._cuda_event is not None:
            # On GPU the compute stream (the waiting thread's current stream on the buffers'
            # device) waits on the copy stream's event; the CPU does not block.
            torch.cuda.current_stream(self._device).wait_event(self._cuda_event)
        return stall


PrefixSource = Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""Given a layer, the loaded prefix K and V of that layer as [1, kv_heads, n, head_dim] parts."""


class PrefixLayer(DynamicLayer):
    """KV of one layer: `prefix_len` tokens filled by the loader, then the tokens computed here.

    At its first update the layer waits for its own gate (the sync point), then joins the loaded
    parts and the new states in one concatenation."""

    def __init__(
        self, *, layer: int, prefix_len: int, source: PrefixSource | None, gate: LayerGate | None, stalls: list[float]
    ) -> None:
        super().__init__()
        self.layer = layer
        self.prefix_len = prefix_len
        self.source = source
        self.gate = gate
        self.stalls = stalls

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized and self.prefix_len:
            assert self.gate is not None and self.source is not None
            self.stalls[self.layer] = self.gate.wait()
            self.lazy_initialization(key_states, value_states)
            keys, values = self.source(self.layer)
            self.keys = torch.cat([*(k.to(key_states.dtype) for k in keys), key_states], dim=-2)
            self.values = torch.cat([*(v.to(value_states.dtype) for v in values), value_states], dim=-2)
            self.source = None
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self.prefix_len
        assert self.keys is not None  # set by lazy_initialization, with is_initialized
        return int(self.keys.shape[-2])


class StrataCache(Cache):
    """One PrefixLayer per model layer; with no prefix it behaves as a DynamicCache."""

    def __init__(
        self,
        *,
        layers: int,
        prefix_len: int = 0,
        source: PrefixSource | None = None,
        gates: list[LayerGate] | None = None,
    ) -> None:
        self.stalls = [0.0] * layers
        built: list[CacheLayerMixin | LinearAttentionCacheLayerMixin] = [
            PrefixLayer(
                layer=i, prefix_len=prefix_len, source=source, gate=gates[i] if gates else None, stalls=self.stalls
            )
            for i in range(layers)
        ]
        super().__init__(layers=built)

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hand a layer its whole KV ([1, kv_heads, tokens, head_dim]) computed elsewhere (a fused
        prefill), without copying it; decoding appends to it as usual."""
        entry = self.layers[layer]
        assert isinstance(entry, PrefixLayer)
        entry.lazy_initialization(keys, values)
        entry.keys, entry.values = keys, values
        entry.prefix_len = 0

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of a layer as [1, kv_heads, tokens, head_dim] tensors."""
        entry = cast(PrefixLayer, self.layers[layer])  # every layer is one (see __init__)
        # Asked for once the layer has run or been filled, so both are set.
        return cast(torch.Tensor, entry.keys), cast(torch.Tensor, entry.values)
