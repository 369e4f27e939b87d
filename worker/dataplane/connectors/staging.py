"""A step's loads through staging memory of a bounded size: the layers of the hit blocks are read
into a ring of slots in host memory (pinned where the pages live on a GPU), in the order the
model asks for them, and each slot is scattered into the engine's pages and handed back.

The unit is a piece: one layer of a run of consecutive hit blocks of one load. A load whose
layer fits in a slot is one piece per layer; a larger one goes in several. The reader runs
ahead of the model by as many pieces as the ring holds (every layer of every load when the
budget allows: the whole load is read while the first layers compute, as without a budget), and
waits for a slot when it does not. The budget is `staging_bytes`: slots x slot size never
exceeds it, and a slot holds at least one layer of one block.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from worker.dataplane.buffers import aligned_empty
from worker.dataplane.errors import MISSES
from worker.dataplane.layout import BlockLayout
from worker.dataplane.prefix.cache import LoadFailed
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import ReadResult

log = logging.getLogger("strata.vllm")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One layer of hit blocks [first, first + count) of load `load`."""

    load: int
    layer: int
    first: int
    count: int


@dataclasses.dataclass
class Staged:
    """A piece once read: the slot holding it, or why it could not be read."""

    slot: int
    failure: LoadFailed | None = None


@dataclasses.dataclass
class LoadKeys:
    """What one load reads: its hit blocks' keys, and per block the checksum a copy from the
    remote tier must carry (None: unchecked; see `TieredStore.get_layers`)."""

    keys: list[uuid.UUID]
    expected: list[str] | None = None


def slot_blocks(layout: BlockLayout, budget: int, largest: int) -> int:
    """How many blocks a slot holds: the largest load's whole layer when two such slots fit the
    budget (one read while the other is scattered), else as many as half the budget holds (at
    least one: a budget below one layer of one block is refused)."""
    if budget < layout.layer_bytes:
        raise ValueError(
            f"load_staging_bytes: {budget} bytes cannot hold one layer of one block ({layout.layer_bytes} bytes)"
        )
    return max(1, min(largest, budget // (2 * layout.layer_bytes)))


class StagedLoads:
    """Reads a step's loads piece by piece into a bounded ring of slots (a thread of its own),
    layer-major: layer 0 of every load, then layer 1, ... A consumer takes each layer's pieces
    in order (`take`), scatters them and hands the slot back (`release`); a load that fails at a
    piece fails all its later pieces (they are not read)."""

    def __init__(
        self,
        *,
        store: TieredStore,
        layout: BlockLayout,
        loads: Sequence[LoadKeys],
        budget: int,
        pin: bool = False,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.loads = list(loads)
        self.layers = list(range(layout.layers) if layers is None else layers)
        """The layers read (a pipeline stage reads its own), in order."""
        self._layer_at = {layer: at for at, layer in enumerate(self.layers)}
        largest = max((len(load.keys) for load in self.loads), default=1)
        self.per_slot = slot_blocks(layout, budget, largest)
        self.pieces: list[Piece] = [
            Piece(index, layer, first, min(self.per_slot, len(load.keys) - first))
            for layer in self.layers
            for index, load in enumerate(self.loads)
            for first in range(0, len(load.keys), self.per_slot)
        ]
        slot_bytes = self.per_slot * layout.layer_bytes
        count = max(1, min(len(self.pieces), budget // slot_bytes))
        with torch.inference_mode(False):  # the tiers' I/O threads write into the slots
            self.ring = [aligned_empty(slot_bytes, pin=pin) for _ in range(count)]
        self.staged_bytes = count * slot_bytes
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(count):
            self._free.put(slot)
        self._done: list[threading.Event] = [threading.Event() for _ in self.pieces]
        self._staged: list[Staged | None] = [None] * len(self.pieces)
        self.failed: dict[int, LoadFailed] = {}
        """Loads that failed, by index, at their first failed piece."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-staged-loads", daemon=True)
        self.started_at = 0.0
        self.finished_at = 0.0
        self.served: collections.Counter[str] = collections.Counter()
        """Bytes read, by the tier that served them."""
        self.served_until: dict[str, float] = {}
        self.layer_loaded: list[float] = [0.0] * layout.layers
        """When each layer's last piece was in (seconds after the start)."""

    def start(self) -> StagedLoads:
        self.started_at = time.perf_counter()
        self._thread.start()
        return self

    def layer_pieces(self, layer: int) -> list[int]:
        """The pieces of `layer`, in the order they are read."""
        per_layer = len(self.pieces) // len(self.layers)
        at = self._layer_at[layer]
        return list(range(at * per_layer, (at + 1) * per_layer))

    def take(self, piece: int, timeout: float | None = None) -> tuple[torch.Tensor | None, LoadFailed | None]:
        """Wait for a piece: the bytes of its layer of its blocks (block by block), or the failure
        of its load (None, failure); past `timeout` seconds, a failure saying so (its load is
        given up: its later pieces are not read)."""
        info = self.pieces[piece]
        if not self._done[piece].wait(timeout):
            failure = LoadFailed(info.layer, info.first, TimeoutError(f"not read within {timeout:.1f} s"))
            self.fail(info.load, failure)
            return None, failure
        staged = self._staged[piece]
        assert staged is not None
        if staged.failure is not None:
            return None, staged.failure
        return self.ring[staged.slot][: info.count * self.layout.layer_bytes], None

    def release(self, piece: int) -> None:
        """The piece is scattered: its slot takes the next one."""
        staged = self._staged[piece]
        if staged is not None and staged.slot >= 0:
            self._free.put(staged.slot)
            staged.slot = -1

    def fail(self, load: int, failure: LoadFailed) -> None:
        """A consumer found load `load` failed: its pieces not read yet are not read."""
        self.failed.setdefault(load, failure)

    def stop(self) -> None:
        """Read no more pieces (a read under way lands in its slot, which nothing scatters)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Stop reading and wait for the reader (at most `timeout` seconds): whether it is done."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _slot(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        try:
            for index, piece in enumerate(self.pieces):
                if piece.load in self.failed:
                    self._finish(index, Staged(-1, self.failed[piece.load]))
                    continue
                slot = self._slot()
                if slot is None:  # cancelled: every piece left fails
                    for rest in range(index, len(self.pieces)):
                        self._finish(
                            rest, Staged(-1, LoadFailed(self.pieces[rest].layer, 0, RuntimeError("cancelled")))
                        )
                    return
                self._finish(index, self._read(piece, slot))
        except BaseException as exc:  # noqa: BLE001 - a reader bug must fail the pieces, never hang the model
            log.exception("the step's loads failed")
            for rest, done in enumerate(self._done):
                if not done.is_set():
                    self._finish(rest, Staged(-1, LoadFailed(self.pieces[rest].layer, 0, exc)))
        finally:
            self.finished_at = time.perf_counter()

    def _read(self, piece: Piece, slot: int) -> Staged:
        load = self.loads[piece.load]
        blocks = range(piece.first, piece.first + piece.count)
        outs = list(self.ring[slot][: piece.count * self.layout.layer_bytes].view(piece.count, -1).unbind(0))
        futures = self.store.get_layers(
            [load.keys[b] for b in blocks],
            layers=piece.layer,
            outs=outs,
            expected=None if load.expected is None else [load.expected[b] for b in blocks],
        )
        for position, future in zip(blocks, futures, strict=True):
            error = future.exception()
            if error is None:
                self._count(future)
                continue
            if not isinstance(error, MISSES):
                raise error
            failure = LoadFailed(piece.layer, position, error)
            self.failed[piece.load] = failure
            for rest in futures:  # no read lands in the slot after it is handed back
                rest.exception()
            self._free.put(slot)
            return Staged(-1, failure)
        self.layer_loaded[piece.layer] = time.perf_counter() - self.started_at
        return Staged(slot)

    def _count(self, future: Future[ReadResult]) -> None:
        result = future.result()
        self.served[result.tier] += result.nbytes
        self.served_until[result.tier] = time.perf_counter()

    def _finish(self, index: int, staged: Staged) -> None:
        self._staged[index] = staged
        self._done[index].set()
