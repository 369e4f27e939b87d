"""The layer-wise loader: brings layer 0 of every hit block, then layer 1, ... while the model computes."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from worker.dataplane.buffers import aligned_empty
from worker.dataplane.engine.cache import LayerGate, LoadFailed
from worker.dataplane.errors import MISSES
from worker.dataplane.layout import BlockLayout
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import ReadResult

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
        self._slots = [list(raw.view(blocks, layout.layer_bytes).unbind(0)) if blocks else [] for raw in self.raw]

    def slot(self, layer: int, block: int) -> torch.Tensor:
        """The bytes of `layer` of hit block `block` (a tier's destination)."""
        return self._slots[layer][block]

    def slots(self, layer: int) -> list[torch.Tensor]:
        """`slot(layer, j)` of every hit block j, in order: back to back in one buffer, so a
        tier can fill them with one gather."""
        return self._slots[layer]

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
    """Loads every layer of the hit blocks in order, opening each layer's gate as soon as that
    layer is complete; a failed read fails that layer's gate (and all later ones).

    By default a thread of its own does the loading while the model computes. With `inline`,
    each layer is read in the thread that waits at its gate, right before that layer computes:
    for reads that are themselves CPU work (the device tier when it lives in CPU memory), a
    second thread would only take a core from the model's own threads."""

    def __init__(self, *, store: TieredStore, hits: Sequence[Hit], buffers: PrefixBuffers,
                 inline: bool = False) -> None:
        self.store = store
        self.hits = list(hits)
        self.keys = [hit.key for hit in self.hits]
        self.buffers = buffers
        self.inline = inline
        self.gates = [LayerGate() for _ in range(buffers.layout.layers)]
        self.timings: list[LayerTiming] = []
        self._stop = threading.Event()
        self._thread = None if inline else threading.Thread(target=self._run, name="strata-loader", daemon=True)
        self._next = 0  # the next layer an inline load reads
        self._lock = threading.Lock()
        if inline:
            for layer, gate in enumerate(self.gates):
                gate.fill = functools.partial(self._fill_to, layer)
        self.started_at = 0.0
        self.finished_at = 0.0

    def start(self) -> LayerLoader:
        self.started_at = time.perf_counter()
        if self._thread is not None:
            self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
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
            self._fail_from(0, LoadFailed(0, 0, exc))
        finally:
            self.finished_at = time.perf_counter()

    def _request(self, layer: int) -> list[Future[ReadResult]]:
        # The store reads each block from the fastest tier holding it and falls through to a
        # slower one if that copy turns out missing or corrupt.
        return self.store.get_layers(self.keys, layers=layer, outs=self.buffers.slots(layer))

    def _load(self) -> None:
        """Ask for every layer at once, layer 0 first: a tier serves its reads in the order they
        came, so the medium never waits for the loader between layers. Each layer's gate opens
        as soon as all of its reads are in."""
        requested = [self._request(layer) for layer in range(self.buffers.layout.layers)]
        started = self.started_at
        try:
            for layer, futures in enumerate(requested):
                if self._stop.is_set():
                    self._fail_from(layer, LoadFailed(layer, 0, RuntimeError("load cancelled")))
                    return
                if not self._settle(layer, [future.exception() for future in futures], started):
                    return
                # A layer's reads are served after the previous layer's: its load starts there.
                started = self.timings[-1].finished
        finally:
            for futures in requested:  # no read lands in the buffers after the loader is done
                for future in futures:
                    future.exception()

    def _fill_to(self, layer: int) -> None:
        """Inline loading: read the layers up to `layer` that are not read yet, in order."""
        with self._lock:
            while self._next <= layer and not self.gates[layer].is_set():
                current = self._next
                self._next += 1
                if self._stop.is_set():
                    self._fail_from(current, LoadFailed(current, 0, RuntimeError("load cancelled")))
                else:  # on a failure the gates from `current` on are failed: the loop ends
                    started = time.perf_counter()
                    try:
                        # One batched read straight into the layer's buffer: no future per block.
                        errors = self.store.read_layers(self.keys, layers=current, out=self.buffers.raw[current])
                        self._settle(current, errors, started)
                    except Exception as exc:  # noqa: BLE001 - as in the thread: a loader bug fails the gates
                        log.exception("inline load crashed")
                        self._fail_from(current, LoadFailed(current, 0, exc))
                self.finished_at = time.perf_counter()

    def _settle(self, layer: int, errors: Sequence[BaseException | None], started: float) -> bool:
        """Judge one layer's reads (None for each block read): open its gate, or fail it and
        every later one at the first block that missed. An error that is not a miss is a bug
        and is raised."""
        failure: LoadFailed | None = None
        for position, error in enumerate(errors):
            if error is None:
                continue
            if not isinstance(error, MISSES):
                raise error
            if failure is None:
                failure = LoadFailed(layer, position, error)
        if failure is not None:
            log.warning("load failed, the request recomputes from block %d: %s", failure.block_index, failure)
            self._fail_from(layer, failure)
            return False
        finished = time.perf_counter()
        self.timings.append(LayerTiming(layer, started, finished, len(self.keys) * self.buffers.layout.layer_bytes))
        self.gates[layer].open()
        return True

    def _fail_from(self, layer: int, error: LoadFailed) -> None:
        for gate in self.gates[layer:]:
            if not gate.is_set():
                gate.fail(error)

