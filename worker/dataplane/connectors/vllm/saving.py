"""The worker half's saves: every full block a step completes is copied out of vLLM's pages inside
the step (the pages may be another request's once it ends), then stored in the write-back tier
and registered by the save queue's thread (`connectors.saves`), outside the step.

On the CPU the blocks are gathered from the pages once the forward pass is done. On a GPU
(`layerwise`) each layer is copied as soon as its attention has written it, on a stream of its
own that waits for that layer only (an event per layer), into pinned host memory, so the copies
overlap the layers still computing. A block past `save_staging_bytes` is stored inside the step,
gathered straight into the host pool's slot (counted `write_back.inline`). Under tensor or
pipeline parallel every rank copies its share and the queue's thread gathers the shares to the
first rank, which stores the whole blocks (`sharding`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.saves import SaveQueue
from worker.dataplane.connectors.vllm.metadata import SaveSpec
from worker.dataplane.connectors.vllm.sharding import Gather, Shard
from worker.dataplane.layout import BlockLayout
from worker.dataplane.offload import OffloadManager

log = logging.getLogger("strata.vllm")


@dataclasses.dataclass
class PendingSave:
    """A block being gathered layer by layer as the forward pass writes it (layer-wise saves)."""

    spec: SaveSpec
    index: int
    key: uuid.UUID
    content_key: uuid.UUID
    buffer: torch.Tensor
    layers: set[int] = dataclasses.field(default_factory=set)


Source = torch.Tensor | Callable[[torch.Tensor], BlockChecksum]
"""A block's bytes for the write-back tier: a whole block, or a fill writing it (`store_block`)."""

Poisoned = Callable[[SaveSpec, int], bool]
"""Whether block `index` of a save was computed over a page a failed load left (`failed_pages`)."""


def never_poisoned(spec: SaveSpec, index: int) -> bool:
    return False


class CudaStreams:
    """The CUDA streams and events the layer-wise copies are ordered with (a test stands in its own
    on the CPU to check the order)."""

    def applies(self, device: torch.device) -> bool:
        """Whether pages on `device` are copied on a stream of their own."""
        return device.type == "cuda"

    def side(self, device: torch.device) -> Any:
        """A stream of its own for the copies out of the pages."""
        return torch.cuda.Stream(device)

    def compute(self, device: torch.device) -> Any:
        """The stream the engine computes on."""
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Queue the work inside on `stream`."""
        return torch.cuda.stream(stream)


POISONED_SHARE = 2
"""In a rank's row of copy flags: the share was not copied because this rank's load of the block's
prefix failed (1: copied, 0: not copied)."""


@dataclasses.dataclass(frozen=True)
class Saving:
    """One block to store: where it lies in its request and where its bytes come from."""

    spec: SaveSpec
    index: int
    key: uuid.UUID
    content_key: uuid.UUID
    source: Source


class BlockSaves:
    """Copies the step's new blocks out of the pages and has them stored and registered."""

    def __init__(
        self,
        manager: OffloadManager,
        *,
        layout: BlockLayout,
        shard: Shard,
        gather: Gather | None,
        budget: int,
        deadline_s: float,
        layerwise: bool | None = None,
        streams: CudaStreams | None = None,
    ) -> None:
        self.manager = manager
        self.streams = streams or CudaStreams()
        self.layout = layout
        self.shard = shard
        self.gather = gather
        self.share_layout = shard.layout(layout)
        self.layers = shard.layers(layout)
        self.deadline_s = deadline_s
        """How long a step waits for room in the queue for its shares (tensor or pipeline parallel)."""
        self.layerwise = layerwise
        """None: decided when the pages are attached (layer-wise where they live on a GPU)."""
        self.paged: PagedKV | None = None
        self.gathering: list[PendingSave] | None = None
        """The blocks being copied layer by layer in this step (layer-wise saves)."""
        self._stream: Any = None
        self._warned_no_layers = False
        self._free_buffers: list[torch.Tensor] = []
        """Copies of blocks to reuse (handed back by the save queue's thread, taken by the step)."""
        self.queue = SaveQueue(budget)
        self._writes = threading.Lock()
        """One batch of stores and its registration at a time (the step's or the save queue's)."""
        self._saved: collections.Counter[str] = collections.Counter()
        self._saved_lock = threading.Lock()

    def attach(self, paged: PagedKV) -> None:
        """The pages the blocks are copied from (once vLLM registers its KV caches)."""
        self.paged = paged
        if self.layerwise is None:
            self.layerwise = paged.device.type == "cuda"
        if self.streams.applies(paged.device):
            self._stream = self.streams.side(paged.device)

    def begin(self) -> None:
        """A new step: nothing copied layer by layer yet."""
        self.gathering = None

    def finish(self, saves: Sequence[SaveSpec], poisoned: Poisoned = never_poisoned) -> None:
        """After the forward pass: copy the step's blocks (those not copied layer by layer) and
        hand them over, except those `poisoned` says were computed over a page a failed load left
        (counted `write_back.poisoned`). Under tensor or pipeline parallel this runs whatever the
        step's loads did (every rank must hand over the gather)."""
        if not self.shard.whole:
            self._save_shares(saves, poisoned)
        elif self.layerwise:
            self._commit_layerwise(saves, poisoned)
        elif saves and self.paged is not None:
            self._save(saves, poisoned)

    def take_saved(self) -> collections.Counter[str]:
        """Blocks stored since the last call, by request (by either path)."""
        with self._saved_lock:
            saved, self._saved = self._saved, collections.Counter()
        return saved

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block handed to the save queue is stored (False: not by `timeout`)."""
        return self.queue.drain(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what the save queue still holds (up to `timeout`), then stop its thread."""
        self.queue.close(timeout)

    def save_layer(self, layer: int, saves: Sequence[SaveSpec]) -> None:
        """Layer-wise saves: copy this layer (by its index in the model) of every block the step
        completes, now that its attention has written it."""
        paged = self.paged
        if not self.layerwise or not saves or paged is None:
            return
        if self.gathering is None:
            self.gathering = self._pending(saves)
        if not self.gathering:
            return
        stream = self._stream
        if stream is not None:
            written = self.streams.event()
            written.record(self.streams.compute(paged.device))  # after this layer's attention
            stream.wait_event(written)
        local = self.shard.local(layer, self.layout)
        with self.streams.on(stream) if stream is not None else contextlib.nullcontext():
            for save in self.gathering:
                k_dst, v_dst = self.share_layout.kv_views(save.buffer)[local]
                paged.gather_layer(
                    local, k_dst, v_dst, index=save.index, pages=save.spec.pages, non_blocking=stream is not None
                )
                save.layers.add(layer)

    def _pending(self, saves: Sequence[SaveSpec]) -> list[PendingSave]:
        """The blocks to gather: those the write-back tier lacks. Ranks of a tensor-parallel group
        gather every block the step saves (the same list on each, as the gather needs); the first
        rank skips those its tier holds when it stores them."""
        if not self.shard.whole:
            return [
                PendingSave(spec, index, key, content_key, self._buffer())
                for spec in saves
                for index, key, content_key in spec.blocks
            ]
        return [PendingSave(*block, self._buffer()) for block in self._unheld(saves)]

    def _unheld(self, saves: Sequence[SaveSpec]) -> Iterator[tuple[SaveSpec, int, uuid.UUID, uuid.UUID]]:
        """The blocks of `saves` the write-back tier does not hold yet: (spec, index, key, content key)."""
        for spec in saves:
            try:
                held = self.manager.holds([key for _, key, _ in spec.blocks])
            except Exception as exc:  # noqa: BLE001 - a tier that cannot answer takes no write either
                log.warning("request %s: blocks not saved: %s", spec.request_id, exc)
                continue
            for (index, key, content_key), have in zip(spec.blocks, held, strict=True):
                if not have:
                    yield spec, index, key, content_key

    def _buffer(self) -> torch.Tensor:
        with contextlib.suppress(IndexError):  # the save queue's thread hands buffers back meanwhile
            return self._free_buffers.pop()
        with torch.inference_mode(False):
            pinned = self.paged is not None and self.paged.device.type == "cuda"
            return self.share_layout.empty(pin=pinned)

    def _save(self, saves: Sequence[SaveSpec], poisoned: Poisoned) -> None:
        """The CPU path: copy each new block out of the pages into a buffer the save queue has
        room for, and hand them over; a block past its budget is gathered straight into the
        write-back tier's slot inside the step."""
        paged = self.paged
        assert paged is not None
        queued: list[Saving] = []
        inline: list[Saving] = []
        nbytes = self.layout.block_bytes
        for spec, index, key, content_key in self._unheld(saves):
            if poisoned(spec, index):
                self.manager.counters.add("write_back.poisoned")
                continue
            if self.queue.reserve(nbytes):
                buffer = self._buffer()
                try:
                    paged.gather(buffer, index=index, pages=spec.pages)
                except BaseException:
                    self.queue.cancel(nbytes)
                    self._free_buffers.append(buffer)
                    raise
                queued.append(Saving(spec, index, key, content_key, buffer))
            else:
                inline.append(Saving(spec, index, key, content_key, self._filler(key, index, spec.pages)))
        self._hand_over(queued, nbytes)
        if inline:
            self.manager.counters.add("write_back.inline", len(inline))
            self._store(inline)

    def _hand_over(self, queued: list[Saving], nbytes: int, *, copied: Any = None) -> None:
        """Give copies (reserved, `nbytes` each) to the save queue's thread to store; it reads them
        once `copied` (a CUDA event after the copies, or None) is done."""
        if not queued:
            return

        def store() -> None:
            try:
                if copied is not None:
                    copied.synchronize()
                self._store(queued)
            finally:
                self._free_buffers.extend(s.source for s in queued if isinstance(s.source, torch.Tensor))

        self.queue.submit(store, nbytes * len(queued))

    def _store(self, blocks: Sequence[Saving]) -> None:
        """Store blocks in the write-back tier (those it does not hold yet: another step may have
        stored one since it was copied) and register them in one batch."""
        manager = self.manager
        if not blocks:
            return
        with self._writes:
            try:
                held = manager.holds([block.key for block in blocks])
            except Exception as exc:  # noqa: BLE001 - a tier that cannot answer takes no write either
                log.warning("%d blocks not saved: %s", len(blocks), exc)
                return
            registrations = []
            saved: collections.Counter[str] = collections.Counter()
            for block, have in zip(blocks, held, strict=True):
                if have:
                    continue
                source = block.source
                registration = manager.store_block(
                    key=block.key,
                    content_key=block.content_key,
                    position=block.index * self.layout.block_tokens,
                    namespace=block.spec.namespace,
                    data=source if isinstance(source, torch.Tensor) else None,
                    fill=None if isinstance(source, torch.Tensor) else source,
                )
                if registration is not None:
                    registrations.append(registration)
                    saved[block.spec.request_id] += 1
            manager.register(registrations)
        with self._saved_lock:
            self._saved.update(saved)

    def _commit_layerwise(self, saves: Sequence[SaveSpec], poisoned: Poisoned) -> None:
        """Store the blocks gathered layer by layer in this step, once their copies are done: on
        the save queue's thread (it waits for the copies) as far as its budget goes, the rest
        here. A block missing a layer is not stored, and counted (`write_back.incomplete`): so is
        every block of a step in which no layer was handed over (a step the engine replayed as
        one CUDA graph, which runs no hooks), never silently dropped."""
        pending, self.gathering = self.gathering, None
        if pending is None and saves:
            pending = self._pending(saves)  # the blocks this step was to save, none gathered
            if pending and not self._warned_no_layers:
                self._warned_no_layers = True
                log.warning(
                    "a step's blocks were not saved: no layer was handed over (the connector needs piecewise "
                    "CUDA graphs, not full ones); such blocks are counted as write_back.incomplete"
                )
        if not pending:
            return
        copied = self._copies_done()
        whole: list[Saving] = []
        for save in pending:
            if poisoned(save.spec, save.index):
                self.manager.counters.add("write_back.poisoned")
                self._free_buffers.append(save.buffer)
            elif len(save.layers) == len(self.layers):
                whole.append(Saving(save.spec, save.index, save.key, save.content_key, save.buffer))
            else:  # a layer the model never handed over (a step without attention metadata)
                self.manager.counters.add("write_back.incomplete")
                self._free_buffers.append(save.buffer)
        nbytes = self.share_layout.block_bytes
        queued: list[Saving] = []
        inline: list[Saving] = []
        for block in whole:
            (queued if self.queue.reserve(nbytes) else inline).append(block)
        self._hand_over(queued, nbytes, copied=copied)
        if inline:
            if copied is not None:
                copied.synchronize()
            self.manager.counters.add("write_back.inline", len(inline))
            try:
                self._store(inline)
            finally:
                self._free_buffers.extend(block.source for block in inline if isinstance(block.source, torch.Tensor))

    def _copies_done(self) -> Any:
        """After the step's layer-wise copies were queued on the save stream: an event the save
        queue's thread waits for before it reads them, and which the compute stream waits for
        before its next work (None on the CPU, where the copies are done when queued). vLLM hands
        a page to another request once the step ends, and the next step's kernels write it: they
        must not run before the copy out of it has read it."""
        if self._stream is None:
            return None
        assert self.paged is not None
        copied = self.streams.event()
        copied.record(self._stream)
        self.streams.compute(self.paged.device).wait_event(copied)
        return copied

    def _save_shares(self, saves: Sequence[SaveSpec], poisoned: Poisoned) -> None:
        """Tensor or pipeline parallel: every rank copies its share of each block the step saves
        now, and hands the save queue a gather of the copies to the first rank, which stores the
        whole blocks on its queue's thread (`sharding`). Every rank hands one gather over for a
        step with saves, whatever failed on it: a rank that skipped it would stall the others. A
        block whose share some rank could not copy is not stored, and counted
        (`write_back.incomplete`); nor is one that some rank computed over a page its failed load
        left (`write_back.poisoned`: only that rank knows of its failure when the step ends)."""
        planned = [(spec, index, key, content_key) for spec in saves for index, key, content_key in spec.blocks]
        if not planned:
            return
        pending, self.gathering = self.gathering, None
        mine = self.share_layout.block_bytes
        nbytes = (len(planned) + 1) * self.shard.share_bytes(self.layout)
        self.queue.hold(nbytes, timeout=self.deadline_s)
        rows = torch.zeros(len(planned) + 1, nbytes // (len(planned) + 1), dtype=torch.uint8)
        # The last row: whether each share was copied (1), not copied (0), or poisoned here.
        if pending is None and self.layerwise and not self._warned_no_layers:
            self._warned_no_layers = True
            log.warning(
                "a step's blocks were not saved: no layer was handed over (the connector needs piecewise "
                "CUDA graphs, not full ones); such blocks are counted as write_back.incomplete"
            )
        try:
            if self.layerwise:
                if self._stream is not None:
                    self._stream.synchronize()
                for row, save in enumerate(pending or ()):
                    if poisoned(save.spec, save.index):
                        rows[-1, row] = POISONED_SHARE
                    elif len(save.layers) == len(self.layers):
                        rows[row, :mine].copy_(save.buffer)
                        rows[-1, row] = 1
                    self._free_buffers.append(save.buffer)
            else:
                assert self.paged is not None
                for row, (spec, index, _, _) in enumerate(planned):
                    if poisoned(spec, index):
                        rows[-1, row] = POISONED_SHARE
                        continue
                    self.paged.gather(rows[row, :mine], index=index, pages=spec.pages)
                    rows[-1, row] = 1
        except Exception:  # noqa: BLE001 - the shares not copied are not stored; the gather still runs
            log.exception("this rank's share of the step's blocks could not be copied")
        gather = self.gather
        assert gather is not None

        def travel() -> None:
            shares = gather(rows)
            if shares is None:  # not the first rank: it stores nothing
                return
            flags = [[int(share[-1, row]) for share in shares] for row in range(len(planned))]
            whole = [all(flag == 1 for flag in row) for row in flags]
            poisoned_rows = sum(POISONED_SHARE in row for row in flags)
            if poisoned_rows:
                self.manager.counters.add("write_back.poisoned", poisoned_rows)
            if whole.count(False) > poisoned_rows:
                self.manager.counters.add("write_back.incomplete", whole.count(False) - poisoned_rows)
            self._store(
                [
                    Saving(spec, index, key, content_key, self._assembler(key, [share[row] for share in shares]))
                    for row, (spec, index, key, content_key) in enumerate(planned)
                    if whole[row]
                ]
            )

        self.queue.submit(travel, nbytes)

    def _assembler(self, key: uuid.UUID, shares: list[torch.Tensor]) -> Callable[[torch.Tensor], BlockChecksum]:
        return self._fill(key, lambda block: self.shard.assemble(self.layout, block, shares))

    def _filler(self, key: uuid.UUID, index: int, pages: list[int]) -> Callable[[torch.Tensor], BlockChecksum]:
        paged = self.paged
        assert paged is not None
        return self._fill(key, lambda block: paged.gather(block, index=index, pages=pages))

    def _fill(self, key: uuid.UUID, write: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], BlockChecksum]:
        """A fill for `store_block`: `write` puts the block's bytes into the tier's memory, which is
        then hashed with the write-back tier's hasher."""
        layout, hasher = self.layout, self.manager.target.hasher

        def fill(block: torch.Tensor) -> BlockChecksum:
            write(block)
            checksum = hasher.checksum(key, block, layout)
            assert isinstance(checksum, BlockChecksum)  # a whole block
            return checksum

        return fill
