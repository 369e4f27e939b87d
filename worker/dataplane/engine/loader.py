"""The layer-wise loader: brings layer 0 of every hit block, then layer 1, ... while the model computes."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from worker.dataplane.buffers import aligned_empty
from worker.dataplane.engine.cache import LayerGate, LoadFailed
from worker.dataplane.errors import MISSES
from worker.dataplane.layout import BlockLayout
from worker.dataplane.store import TieredStore

log = logging.getLogger("strata.engine")


@dataclasses.dataclass(frozen=True)
class Hit:
    """One block of the prompt found in a tier."""

    index: int
    """Position of the block in the prompt (0 = first)."""
    key: uuid.UUID
    tier: str


class PrefixBuffers:
    """Per layer, one aligned buffer holding that layer of every hit block, block by block:
    [blocks, 2 (K, V), block_tokens, kv_heads, head_dim]. A tier reads block j's layer straight
    into slot j, and attention reads K and V through views of it."""

    def __init__(self, *, layout: BlockLayout, blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.blocks = blocks
        shape = (blocks, 2, *layout.kv_shape)
        self.raw = [aligned_empty(blocks * layout.layer_bytes, device=device) for _ in range(layout.layers)]
        self.typed = [raw.view(layout.dtype).view(shape) for raw in self.raw]

    def slot(self, layer: int, block: int) -> torch.Tensor:
        """The bytes of `layer` of hit block `block` (a tier's destination)."""
        size = self.layout.layer_bytes
        return self.raw[layer][block * size : (block + 1) * size]

    def kv_parts(self, layer: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of K and V of the first `tokens` prefix tokens of a layer, one [1, kv_heads, n,
        head_dim] view per block, so attention's concatenation is the only copy."""
        typed = self.typed[layer]
        size = self.layout.block_tokens
        keys, values = [], []
        for block in range((tokens + size - 1) // size):
            n = min(size, tokens - block * size)
            keys.append(typed[block, 0, :n].permute(1, 0, 2).unsqueeze(0))
            values.append(typed[block, 1, :n].permute(1, 0, 2).unsqueeze(0))
        return keys, values


@dataclasses.dataclass
class LayerTiming:
    layer: int
    started: float
    finished: float
    bytes: int


class LayerLoader:
    """A thread that loads every layer of the hit blocks in order, opening each layer's gate as
    soon as that layer is complete; a failed read fails that layer's gate (and all later ones)."""

    def __init__(self, *, store: TieredStore, hits: Sequence[Hit], buffers: PrefixBuffers) -> None:
        self.store = store
        self.hits = list(hits)
        self.buffers = buffers
        self.gates = [LayerGate() for _ in range(buffers.layout.layers)]
        self.timings: list[LayerTiming] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-loader", daemon=True)
        self.started_at = 0.0
        self.finished_at = 0.0

    def start(self) -> LayerLoader:
        self.started_at = time.perf_counter()
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()

    def join(self) -> None:
        self._thread.join()

    def wait_all(self) -> None:
        """Block until every layer is loaded (load-then-compute); raises the first LoadFailed."""
        for gate in self.gates:
            gate.wait()

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - a loader bug must fail the gates, not hang compute
            log.exception("loader crashed")
            error = LoadFailed(0, 0, exc)
            for gate in self.gates:
                if not gate.is_set():
                    gate.fail(error)
        finally:
            self.finished_at = time.perf_counter()

    def _load(self) -> None:
        """Ask for every layer at once, layer 0 first: a tier serves its reads in the order they
        came, so the medium never waits for the loader between layers. Each layer's gate opens
        as soon as all of its reads are in."""
        layout = self.buffers.layout
        keys = [hit.key for hit in self.hits]
        # The store reads each block from the fastest tier holding it and falls through to a
        # slower one if that copy turns out missing or corrupt.
        requested = [
            self.store.get_layers(
                keys, layers=layer, outs=[self.buffers.slot(layer, position) for position in range(len(keys))]
            )
            for layer in range(layout.layers)
        ]
        started = self.started_at
        try:
            for layer, futures in enumerate(requested):
                if self._stop.is_set():
                    self._fail_from(layer, LoadFailed(layer, 0, RuntimeError("load cancelled")))
                    return
                failure: LoadFailed | None = None
                for position, future in enumerate(futures):
                    try:
                        future.result()
                    except MISSES as exc:
                        if failure is None:
                            failure = LoadFailed(layer, position, exc)
                if failure is not None:
                    log.warning("load failed, the request recomputes from block %d: %s", failure.block_index, failure)
                    self._fail_from(layer, failure)
                    return
                # A layer's reads are served after the previous layer's: its load starts there.
                finished = time.perf_counter()
                self.timings.append(LayerTiming(layer, started, finished, len(keys) * layout.layer_bytes))
                started = finished
                self.gates[layer].open()
        finally:
            for futures in requested:  # no read lands in the buffers after the loader is done
                for future in futures:
                    future.exception()

    def _fail_from(self, layer: int, error: LoadFailed) -> None:
        for gate in self.gates[layer:]:
            if not gate.is_set():
                gate.fail(error)
