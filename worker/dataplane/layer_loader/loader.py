"""The layer-wise loader: brings layer 0 of every hit block, then layer 1, ... while the model computes.

On the CPU a loader thread reads each layer straight into the buffers attention reads, and each
layer's gate opens once its reads are in. On a GPU the buffers live in device memory: blocks held
in the device tier are read into them directly (a copy within the device, waited for by the
tier), every other block is read into pinned host memory (a file, socket or shared-memory read
ends there anyway, and is verified there) and the loader copies each layer to the device on a
CUDA stream of its own. The layer's gate then carries the event recorded after that copy: the
compute stream waits on the event, and the CPU does not wait for the copy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from worker.dataplane.buffers import aligned_empty, runs
from worker.dataplane.errors import MISSES
from worker.dataplane.layout import BlockLayout
from worker.dataplane.offload_records import Hit, TierLoad
from worker.dataplane.prefix.cache import LayerGate, LoadDeadline, LoadFailed
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import ReadResult

log = logging.getLogger("strata.engine")


class PrefixBuffers:
    """Per layer, one aligned buffer holding that layer of every hit block, block by block:
    [blocks, 2 (K, V), block_tokens, kv_heads, head_dim], on the model's device. A tier (or the
    loader's copy from host memory) fills block j's layer into slot j, and attention reads K and V
    through views of it."""

    def __init__(self, *, layout: BlockLayout, blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.blocks = blocks
        self.device = torch.device(device)
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
    second thread would only take a core from the model's own threads.

    With `verify_remote` (a manager with a directory: `OffloadManager.verifies_remote`), a block
    is read from the shared remote tier only when the copy there carries the checksum its hit
    names (`Hit.checksum`), and not at all for a hit that names none: the store checks the
    header read with each layer against it before any of the block's bytes count as loaded, and
    a copy that differs fails its layer's gate like any miss (`TieredStore.get_layers`; the
    caller's quarantine of the failed block drops it: `OffloadManager.quarantine`)."""

    def __init__(
        self,
        *,
        store: TieredStore,
        hits: Sequence[Hit],
        buffers: PrefixBuffers,
        inline: bool = False,
        verify_remote: bool = False,
        deadline_s: float | None = None,
    ) -> None:
        self.store = store
        self.deadline_s = deadline_s
        """Longest the load may take: a layer still not in by then fails its gate and every later
        one (LoadDeadline), and `join` waits no longer (None: no deadline)."""
        self.deadline: float | None = None
        self.hits = list(hits)
        self.keys = [hit.key for hit in self.hits]
        self.expected = [hit.checksum for hit in self.hits] if verify_remote else None
        """Per block, the checksum a copy read from the remote tier must carry (None: unchecked)."""
        self.buffers = buffers
        self.inline = inline
        self.device = buffers.device
        self.gates = [LayerGate() for _ in range(buffers.layout.layers)]
        self.timings: list[LayerTiming] = []
        self._stop = threading.Event()
        self._thread = None if inline else threading.Thread(target=self._run, name="strata-loader", daemon=True)
        self._next = 0  # the next layer an inline load reads
        self._lock = threading.Lock()
        if inline:
            for layer, gate in enumerate(self.gates):
                gate.fill = functools.partial(self._fill_to, layer)
        self._requested: list[list[Future[ReadResult]]] = []
        self.started_at = 0.0
        self.finished_at = 0.0
        # What each tier served (bytes) and when its last read landed, from the reads' own futures.
        self._served_lock = threading.Lock()
        self._served_bytes: collections.Counter[str] = collections.Counter()
        self._served_until: dict[str, float] = {}
        # Off the CPU, blocks of tiers that read into host memory are read into pinned host memory
        # and copied to the buffers by the loader (`_copy_staged`); those of tiers that read into
        # device memory (the device tier, the disk with GPUDirect Storage), and everything on
        # the CPU, are read in place.
        self._staged = staged_hits(store, self.hits) if self.device.type != "cpu" and not inline else []
        self._staging: torch.Tensor | None = None
        self._staged_runs = runs(self._staged)
        if self._staged:
            layer_bytes = buffers.layout.layer_bytes
            # A normal tensor even when the engine builds the loader in inference mode: the tiers'
            # I/O threads write into it.
            with torch.inference_mode(False):
                pinned = aligned_empty(buffers.layout.layers * len(self._staged) * layer_bytes, pin=True)
                self._staging = pinned.view(buffers.layout.layers, len(self._staged), layer_bytes)
        self._stream: torch.cuda.Stream | None = None
        self._buffers_free: torch.cuda.Event | None = None
        if self.device.type == "cuda":
            # The buffers may take memory that kernels still queued on the compute stream were
            # using (the caching allocator hands freed memory to the next allocation on the same
            # stream at once): nothing writes into them before that work is done.
            self._buffers_free = torch.cuda.Event()
            self._buffers_free.record(torch.cuda.current_stream(self.device))
            if self._staged:
                self._stream = torch.cuda.Stream(self.device)
                for raw in buffers.raw:
                    # Freed buffers are not reused while copies queued on the loader's stream run
                    # (the layers after a failed one are never waited for by the compute stream).
                    raw.record_stream(self._stream)

    def start(self) -> LayerLoader:
        self.started_at = time.perf_counter()
        if self.deadline_s is not None and self._thread is not None:
            # (an inline load reads in the waiting thread itself: nothing to wait for)
            self.deadline = self.started_at + self.deadline_s
            for layer, gate in enumerate(self.gates):
                gate.deadline = self.deadline
                gate.expire = functools.partial(self._expire, layer)
        if self._thread is not None:
            self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()

    def join(self) -> bool:
        """Wait for the loader thread, at most until the deadline; False: it still waits on a
        tier and is left behind (its reads land in buffers it alone still holds)."""
        if self._thread is None:
            return True
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _expire(self, layer: int) -> None:
        """`layer` is not in by the deadline: fail its gate and every later one at the first
        block whose read has not landed, and stop loading."""
        self._stop.set()
        futures = self._requested[layer] if layer < len(self._requested) else []
        block = next((i for i, future in enumerate(futures) if not future.done()), 0)
        cause = LoadDeadline(f"layer {layer} was not loaded within {self.deadline_s:g} s")
        log.warning("load past its deadline, the request recomputes from block %d: %s", block, cause)
        self._fail_from(layer, LoadFailed(layer, block, cause))

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
        futures = self.store.get_layers(self.keys, layers=layer, outs=self._destinations(layer), expected=self.expected)
        for future in futures:
            future.add_done_callback(self._served)
        return futures

    def _destinations(self, layer: int) -> list[torch.Tensor]:
        """Where each block's layer is read to: its slot of the buffer, or its row of the host
        staging buffer for a block the loader copies to the device itself."""
        outs = list(self.buffers.slots(layer))
        if self._staging is not None:
            for row, block in enumerate(self._staged):
                outs[block] = self._staging[layer, row]
        return outs

    def _served(self, future: Future[ReadResult]) -> None:
        """A read's future finished (in the tier's thread, or here for reads done on return)."""
        if future.cancelled() or future.exception() is not None:
            return
        result = future.result()
        landed = time.perf_counter()
        with self._served_lock:
            self._served_bytes[result.tier] += result.nbytes
            self._served_until[result.tier] = max(self._served_until.get(result.tier, landed), landed)

    def tier_loads(self) -> list[TierLoad]:
        """Bytes and seconds per tier that served this load, to learn each tier's speed from.

        Every read is queued when the load starts and each tier serves its queue in order, beside
        the other tiers: a tier's time runs from the start to the moment its last read landed
        (the tier that served a block, after any fall-through, is the one credited). An inline
        load reads one layer of every block at a time, in one call that does not say which tier
        served what: its reading time is split between the hits' tiers by their share of the
        blocks (the engine loads inline only when every hit is in the device tier, one tier)."""
        if self.inline:
            seconds = sum(t.finished - t.started for t in self.timings)
            total = sum(t.bytes for t in self.timings)
            shares = collections.Counter(hit.tier for hit in self.hits)
            return (
                [
                    TierLoad(tier, total * count // len(self.hits), seconds * count / len(self.hits))
                    for tier, count in shares.items()
                ]
                if self.hits and total
                else []
            )
        with self._served_lock:
            return [
                TierLoad(tier, self._served_bytes[tier], self._served_until[tier] - self.started_at)
                for tier in self._served_bytes
            ]

    def _load(self) -> None:
        """Ask for every layer at once, layer 0 first: a tier serves its reads in the order they
        came, so the medium never waits for the loader between layers. Each layer's gate opens
        as soon as all of its reads are in."""
        if self._buffers_free is not None:
            self._buffers_free.synchronize()
        requested = self._requested = [self._request(layer) for layer in range(self.buffers.layout.layers)]
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
            if self._buffers_free is not None:
                self._buffers_free.synchronize()
                self._buffers_free = None
            while self._next <= layer and not self.gates[layer].is_set():
                current = self._next
                self._next += 1
                if self._stop.is_set():
                    self._fail_from(current, LoadFailed(current, 0, RuntimeError("load cancelled")))
                else:  # on a failure the gates from `current` on are failed: the loop ends
                    started = time.perf_counter()
                    try:
                        # One batched read straight into the layer's buffer: no future per block.
                        errors = self.store.read_layers(
                            self.keys, layers=current, out=self.buffers.raw[current], expected=self.expected
                        )
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
        self.gates[layer].open(cuda_event=self._copy_staged(layer), device=self.device)
        return True

    def _copy_staged(self, layer: int) -> torch.cuda.Event | None:
        """Copy a layer's blocks read into host memory to their device slots: on a GPU queued on the
        loader's stream, returning the event that marks them done (what the compute stream waits
        on); elsewhere (no stream) done on return."""
        if self._staging is None:
            return None
        layer_bytes = self.buffers.layout.layer_bytes
        raw, staging = self.buffers.raw[layer], self._staging[layer]
        on_stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with on_stream:
            for block, row, count in self._staged_runs:
                raw[block * layer_bytes : (block + count) * layer_bytes].copy_(
                    staging[row : row + count].view(-1), non_blocking=self._stream is not None
                )
            if self._stream is None:
                return None
            copied = torch.cuda.Event()
            copied.record(self._stream)
            return copied

    def _fail_from(self, layer: int, error: LoadFailed) -> None:
        for gate in self.gates[layer:]:
            if not gate.is_set():
                gate.fail(error)


def staged_hits(store: TieredStore, hits: Sequence[Hit]) -> list[int]:
    """The hits a load onto a GPU reads into pinned host memory and copies itself: those whose
    tier cannot read into device memory (see `Tier.reads_into_device`)."""
    direct = {name: store.tier(name).reads_into_device for name in {hit.tier for hit in hits}}
    return [j for j, hit in enumerate(hits) if not direct[hit.tier]]
