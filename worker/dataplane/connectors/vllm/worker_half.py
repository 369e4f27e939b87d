"""The connector's worker half: moves the bytes between vLLM's pages and Strata's tiers.

start_load_kv: the step's loads are read layer by layer (layer 0 of every hit block, then layer
1, ...) into staging memory bounded by `load_staging_bytes` (`connectors.staging`: a load larger
than it goes in pieces); wait_for_layer_load(layer) waits for that layer's pieces only and
scatters each into vLLM's pages (one copy); the wait is the layer's stall. A block read from L3
must carry the checksum the scheduler half's directory lookup registered for it
(`LoadSpec.checksums`).
wait_for_save: the new full blocks are copied out of the pages inside the step, into buffers
bounded by `save_staging_bytes`; a thread stores them in the write-back tier (the copy into the
host pool's slot, hashed on the way) and registers them in one batch, outside the step
(`connectors.saves`). Past the budget a block is stored inside the step, gathered from the pages
straight into the pool's slot (counted `write_back.inline`).
A load that failed (a block corrupt or vanished) reports its pages
(get_block_ids_with_load_errors): vLLM recomputes them.
build_connector_worker_meta: what the step measured (stalls, tier speeds, prefill speed,
counters), back to the scheduler half.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.connectors.pages import PagedKV, layout_of
from worker.dataplane.connectors.saves import SaveQueue
from worker.dataplane.connectors.staging import LoadKeys, StagedLoads, slot_blocks
from worker.dataplane.connectors.vllm.async_loads import AsyncLoads, scatter_piece
from worker.dataplane.connectors.vllm.metadata import (
    LoadReport,
    LoadSpec,
    SaveSpec,
    StrataMetadata,
    StrataWorkerMeta,
)
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.sharding import Gather, Shard
from worker.dataplane.engine.cache import LoadFailed
from worker.dataplane.layout import block_layout

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


@dataclasses.dataclass(frozen=True)
class Saving:
    """One block to store: where it lies in its request and where its bytes come from."""

    spec: SaveSpec
    index: int
    key: uuid.UUID
    content_key: uuid.UUID
    source: Source


@dataclasses.dataclass
class ActiveLoad:
    spec: LoadSpec
    index: int
    """The load's place among the step's staged loads."""
    stalls: list[float]
    failure: LoadFailed | None = None
    scattered: int = 0


class WorkerHalf:
    """Moves the bytes: loads into vLLM's pages layer by layer, saves full blocks from them.

    Saves copy each new block out of the pages inside the step, one of two ways. On the CPU the
    blocks are gathered once the forward pass is done. On a GPU (`layerwise_saves`) each layer is
    copied as soon as its attention has written it, on a stream of its own that waits for that
    layer only (an event per layer), into pinned host memory, so the copies overlap the layers
    still computing. The copies are then stored (hashed into the write-back tier) and registered
    by the save queue's thread, outside the step; a block the queue has no room for is stored
    inside the step."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        layerwise_saves: bool | None = None,
        shard: Shard | None = None,
        gather: Gather | None = None,
    ) -> None:
        self.runtime = runtime
        self.layerwise_saves = layerwise_saves
        """None: decided when the KV caches register (layer-wise where they live on a GPU)."""
        self._warned_no_layers = False
        self.layout = block_layout(runtime.profile)
        self.shard = shard or Shard(rank=0, ranks=1, kv_heads=self.layout.kv_heads)
        if not self.shard.whole and gather is None:
            raise ValueError("a tensor-parallel worker half needs the gather over its ranks")
        self.gather = gather
        self.share_layout = self.shard.layout(self.layout)
        """What this rank's pages hold of a block: its kv heads of its stage's layers."""
        self.layers = self.shard.layers(self.layout)
        """The layers this rank's pages hold (a pipeline stage's own), by their index in the model."""
        slot_blocks(self.layout, runtime.config.load_staging_bytes, 1)  # refuses a budget too small to load
        self.pending: list[PendingSave] | None = None
        self._stream: Any = None
        self._free_buffers: list[torch.Tensor] = []
        """Copies of blocks to reuse (handed back by the save queue's thread, taken by the step)."""
        self.saves = SaveQueue(runtime.config.save_staging_bytes)
        self._writes = threading.Lock()
        """One batch of stores and its registration at a time (the step's or the save queue's)."""
        self._saved: collections.Counter[str] = collections.Counter()
        self._saved_lock = threading.Lock()
        self.manager = runtime.manager
        self.paged: PagedKV | None = None
        self.layer_of: dict[str, int] = {}
        self.meta: StrataMetadata | None = None
        self.loads: list[ActiveLoad] = []
        self.staged: StagedLoads | None = None
        self.deadline = 0.0
        """When this step's loads must be in (perf_counter)."""
        self.async_loads = AsyncLoads(
            store=self.manager.store,
            layout=self.layout,
            shard=self.shard,
            budget=runtime.config.load_staging_bytes,
            deadline_s=runtime.config.load_deadline_seconds,
            verify_remote=lambda: self.manager.verifies_remote,
        )
        self.refused_async: set[str] = set()
        """Asynchronous loads refused by the scheduler: finished (failed) at once."""
        self.invalid: set[int] = set()
        self.report = StrataWorkerMeta()
        self.step_started = 0.0
        self._shipped_counts: dict[str, int] = {}
        self._shipped_events: dict[str, int] = {}

    def register(
        self, kv_caches: Mapping[str, torch.Tensor], backends: Mapping[str, str], layer_index: Callable[[str], int]
    ) -> None:
        names = sorted(kv_caches, key=layer_index)
        if [layer_index(name) for name in names] != list(self.layers):
            raise ValueError(
                f"StrataConnector: this rank's KV caches are of layers {[layer_index(name) for name in names]}, "
                f"its pipeline stage holds layers {self.layers.start}..{self.layers.stop - 1}"
            )
        kinds = {layout_of(backends[name]) for name in names}
        if len(kinds) != 1:
            raise ValueError(
                f"StrataConnector: the layers use different attention backends ({sorted(set(backends.values()))})"
            )
        self.paged = PagedKV([kv_caches[name] for name in names], kind=kinds.pop(), layout=self.share_layout)
        self.layer_of = {name: layer_index(name) for name in names}
        if self.layerwise_saves is None:
            self.layerwise_saves = self.paged.device.type == "cuda"
        if self.paged.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.paged.device)
        log.info(
            "StrataConnector: %d layers of %d-token pages (%s layout, %s) as %s blocks%s",
            len(names),
            self.paged.page_tokens,
            self.paged.kind,
            self.paged.device,
            self.layout.describe(),
            ""
            if self.shard.whole
            else f"; tensor-parallel rank {self.shard.rank} of {self.shard.ranks} holds kv heads "
            f"{self.shard.first}..{self.shard.first + self.shard.heads - 1} of layers "
            f"{self.layers.start}..{self.layers.stop - 1}",
        )

    def bind(self, meta: StrataMetadata) -> None:
        self.meta = meta
        self.pending = None
        self.step_started = time.perf_counter()

    def start_loads(self) -> None:
        meta, paged = self.meta, self.paged
        if meta is None or paged is None:
            return
        loads: list[LoadSpec] = []
        for spec in meta.loads:
            if spec.refused:
                log.warning("request %s: load refused (%s); vLLM recomputes its pages", spec.request_id, spec.refused)
                self._invalidate(spec)
                self.manager.counters.add("load_failures")
                self.report.loads[spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=spec.refused)
                if spec.asynchronous:
                    self.refused_async.add(spec.request_id)
            elif spec.asynchronous:
                self.async_loads.start(spec, paged)
            else:
                loads.append(spec)
        if not loads:
            return
        self.deadline = time.perf_counter() + self.runtime.config.load_deadline_seconds
        verify = self.manager.verifies_remote
        try:
            self.staged = StagedLoads(
                store=self.manager.store,
                layout=self.layout,
                loads=[LoadKeys(list(spec.keys), list(spec.checksums) if verify else None) for spec in loads],
                budget=self.runtime.config.load_staging_bytes,
                pin=paged.device.type == "cuda",
                layers=self.layers,
            ).start()
        except Exception as exc:  # noqa: BLE001 - loads that cannot start are recomputed
            log.exception("this step's loads could not start, recomputing them")
            for spec in loads:
                self._invalidate(spec)
                self.report.loads[spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=str(exc))
            return
        self.loads = [ActiveLoad(spec, index, [0.0] * self.layout.layers) for index, spec in enumerate(loads)]

    def wait_layer(self, layer_name: str) -> None:
        """Scatter this layer of every load into the pages, piece by piece as the staging ring
        hands them over; the wait for each piece is the layer's stall."""
        staged, paged = self.staged, self.paged
        if staged is None or paged is None or not self.loads:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        for piece in staged.layer_pieces(layer):
            info = staged.pieces[piece]
            load = self.loads[info.load]
            spec = load.spec
            try:
                waited = time.perf_counter()
                data, failure = staged.take(piece, timeout=max(0.0, self.deadline - waited))
                load.stalls[layer] += time.perf_counter() - waited
                if load.failure is not None:
                    continue
                if failure is not None or data is None:
                    self._fail(load, failure or LoadFailed(layer, info.first, RuntimeError("piece not read")))
                    continue
                scatter_piece(paged, self.shard, self.layout, spec, info, data)
                if info.first + info.count == len(spec.keys):
                    load.scattered += 1  # the layer's last piece of this load
            except LoadFailed as failure:
                self._fail(load, failure)
            except Exception as exc:  # noqa: BLE001 - never an engine error: the pages are recomputed
                log.exception("request %s: load failed at layer %d", spec.request_id, layer)
                self._fail(load, LoadFailed(layer, info.first, exc))
            finally:
                staged.release(piece)

    def save_layer(self, layer_name: str) -> None:
        """Layer-wise saves: copy this layer of every block the step completes, now that its
        attention has written it."""
        meta, paged = self.meta, self.paged
        if not self.layerwise_saves or meta is None or not meta.saves or paged is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        if self.pending is None:
            self.pending = self._pending(meta.saves)
        if not self.pending:
            return
        stream = self._stream
        if stream is not None:
            written = torch.cuda.Event()
            written.record()  # on the compute stream, after this layer's attention
            stream.wait_event(written)
        local = self.shard.local(layer, self.layout)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for save in self.pending:
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
        pending = []
        for spec in saves:
            try:
                held = self.manager.holds([key for _, key, _ in spec.blocks])
            except Exception as exc:  # noqa: BLE001 - a tier that cannot answer takes no write either
                log.warning("request %s: blocks not saved: %s", spec.request_id, exc)
                continue
            for (index, key, content_key), have in zip(spec.blocks, held, strict=True):
                if not have:
                    pending.append(PendingSave(spec, index, key, content_key, self._buffer()))
        return pending

    def _buffer(self) -> torch.Tensor:
        with contextlib.suppress(IndexError):  # the save queue's thread hands buffers back meanwhile
            return self._free_buffers.pop()
        with torch.inference_mode(False):
            return self.share_layout.empty(pin=self._stream is not None)

    def _fail(self, load: ActiveLoad, failure: LoadFailed) -> None:
        load.failure = failure
        if self.staged is not None:
            self.staged.fail(load.index, failure)  # its later pieces are not read
        spec = load.spec
        self._invalidate(spec)
        self.manager.counters.add("load_failures")
        if isinstance(failure.cause, TimeoutError):  # a slow tier, not a bad block
            self.manager.counters.add("load_deadlines")
        elif failure.block_index < len(spec.keys):
            self.manager.quarantine(spec.keys[failure.block_index], failure.cause, spec.namespace)
        log.warning(
            "request %s: load failed (%s); vLLM recomputes its %d tokens",
            spec.request_id,
            failure,
            spec.end - spec.start,
        )

    def _invalidate(self, spec: LoadSpec) -> None:
        """Every page the load was to fill: vLLM recomputes from the first of them."""
        assert self.paged is not None
        n = self.paged.page_tokens
        self.invalid.update(spec.pages[spec.start // n : -(-spec.end // n)])

    def abandon_loads(self) -> None:
        """Give up every load of this step (their pages are recomputed), after an error the loads'
        own handling did not catch."""
        for load in self.loads:
            if load.failure is None:
                load.failure = LoadFailed(0, 0, RuntimeError("the step's loads were given up"))
                self._invalidate(load.spec)
                self.manager.counters.add("load_failures")

    def finish_step(self) -> None:
        """After the forward pass: settle the loads, then save the step's new full blocks. Under
        tensor parallel the saves run whatever the loads did (every rank must reach the gather)."""
        meta = self.meta
        if meta is None:
            return
        try:
            self._settle_step()
        finally:
            if not self.shard.whole:
                self._save_shares(meta.saves)
        if self.shard.whole and self.layerwise_saves:
            self._commit_layerwise(meta.saves)
        elif self.shard.whole and meta.saves and self.paged is not None:
            self._save(meta.saves)
        forward_s = time.perf_counter() - self.step_started
        if not meta.loads and meta.scheduled_tokens >= self.layout.block_tokens:
            self.report.prefill = (meta.scheduled_tokens, forward_s)
        self.report.prefills_done.extend(meta.prefills_done)

    def _settle_step(self) -> None:
        loads, self.loads = self.loads, []
        staged, self.staged = self.staged, None
        if staged is not None and not staged.join(timeout=max(0.0, self.deadline - time.perf_counter())):
            log.warning("a tier has not answered this step's loads by their deadline; their pages are recomputed")
        for load in loads:
            try:
                assert staged is not None
                self._settle(load, staged, first=load is loads[0])
            except Exception as exc:  # noqa: BLE001 - a load not known to be whole is recomputed
                log.exception("request %s: its load could not be settled; vLLM recomputes it", load.spec.request_id)
                self._invalidate(load.spec)
                self.manager.counters.add("load_failures")
                self.report.loads[load.spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=str(exc))

    def _settle(self, load: ActiveLoad, staged: StagedLoads, *, first: bool) -> None:
        spec = load.spec
        if load.failure is None and load.scattered < len(self.layers):
            # A layer the model never asked for (a step without attention metadata): not loaded.
            self._fail(load, LoadFailed(load.scattered, 0, RuntimeError("layers were not loaded in this step")))
        blocks = dict(collections.Counter(spec.tiers))
        report = LoadReport(
            stalls=load.stalls,
            loaded_at=list(staged.layer_loaded),
            load_s=max(0.0, staged.finished_at - staged.started_at),
            # What each tier served this step, for learning its speed: once, with the step's first load.
            tier_loads=[
                (tier, nbytes, staged.served_until[tier] - staged.started_at) for tier, nbytes in staged.served.items()
            ]
            if first
            else [],
            blocks_by_tier=blocks,
            failure="" if load.failure is None else str(load.failure),
        )
        self.report.loads[spec.request_id] = report
        if load.failure is None:
            tokens = spec.end - spec.start
            self.manager.counters.add("hit_tokens", tokens)
            self.manager.counters.add("reused_tokens.prefix", tokens)
            for tier, count in blocks.items():
                self.manager.counters.add(f"hit_blocks.{tier}", count)

    def _save(self, saves: Sequence[SaveSpec]) -> None:
        """The CPU path: copy each new block out of the pages into a buffer the save queue has
        room for, and hand them over; a block past its budget is gathered straight into the
        write-back tier's slot inside the step."""
        paged = self.paged
        assert paged is not None
        queued: list[Saving] = []
        inline: list[Saving] = []
        nbytes = self.layout.block_bytes
        for spec in saves:
            try:
                held = self.manager.holds([key for _, key, _ in spec.blocks])
            except Exception as exc:  # noqa: BLE001 - a tier that cannot answer takes no write either
                log.warning("request %s: blocks not saved: %s", spec.request_id, exc)
                continue
            for (index, key, content_key), have in zip(spec.blocks, held, strict=True):
                if have:
                    continue
                if self.saves.reserve(nbytes):
                    buffer = self._buffer()
                    try:
                        paged.gather(buffer, index=index, pages=spec.pages)
                    except BaseException:
                        self.saves.cancel(nbytes)
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

        self.saves.submit(store, nbytes * len(queued))

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

    def _commit_layerwise(self, saves: Sequence[SaveSpec]) -> None:
        """Store the blocks gathered layer by layer in this step, once their copies are done: on
        the save queue's thread (it waits for the copies) as far as its budget goes, the rest
        here. A block missing a layer is not stored, and counted (`write_back.incomplete`): so is
        every block of a step in which no layer was handed over (a step the engine replayed as
        one CUDA graph, which runs no hooks), never silently dropped."""
        pending, self.pending = self.pending, None
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
        whole: list[Saving] = []
        for save in pending:
            if len(save.layers) == len(self.layers):
                whole.append(Saving(save.spec, save.index, save.key, save.content_key, save.buffer))
            else:  # a layer the model never handed over (a step without attention metadata)
                self.manager.counters.add("write_back.incomplete")
                self._free_buffers.append(save.buffer)
        copied = None
        if self._stream is not None:
            copied = torch.cuda.Event()
            copied.record(self._stream)
        nbytes = self.share_layout.block_bytes
        queued: list[Saving] = []
        inline: list[Saving] = []
        for block in whole:
            (queued if self.saves.reserve(nbytes) else inline).append(block)
        self._hand_over(queued, nbytes, copied=copied)
        if inline:
            if copied is not None:
                copied.synchronize()
            self.manager.counters.add("write_back.inline", len(inline))
            try:
                self._store(inline)
            finally:
                self._free_buffers.extend(block.source for block in inline if isinstance(block.source, torch.Tensor))

    def _save_shares(self, saves: Sequence[SaveSpec]) -> None:
        """Tensor or pipeline parallel: every rank copies its share of each block the step saves
        now, and hands the save queue a gather of the copies to the first rank, which stores the
        whole blocks on its queue's thread (`sharding`). Every rank hands one gather over for a
        step with saves, whatever failed on it: a rank that skipped it would stall the others. A
        block whose share some rank could not copy is not stored, and counted
        (`write_back.incomplete`)."""
        planned = [(spec, index, key, content_key) for spec in saves for index, key, content_key in spec.blocks]
        if not planned:
            return
        pending, self.pending = self.pending, None
        mine = self.share_layout.block_bytes
        nbytes = (len(planned) + 1) * self.shard.share_bytes(self.layout)
        self.saves.hold(nbytes, timeout=self.runtime.config.load_deadline_seconds)
        rows = torch.zeros(len(planned) + 1, nbytes // (len(planned) + 1), dtype=torch.uint8)
        # The last row: whether each share was copied.
        if pending is None and self.layerwise_saves and not self._warned_no_layers:
            self._warned_no_layers = True
            log.warning(
                "a step's blocks were not saved: no layer was handed over (the connector needs piecewise "
                "CUDA graphs, not full ones); such blocks are counted as write_back.incomplete"
            )
        try:
            if self.layerwise_saves:
                if self._stream is not None:
                    self._stream.synchronize()
                for row, save in enumerate(pending or ()):
                    if len(save.layers) == len(self.layers):
                        rows[row, :mine].copy_(save.buffer)
                        rows[-1, row] = 1
                    self._free_buffers.append(save.buffer)
            else:
                assert self.paged is not None
                for row, (spec, index, _, _) in enumerate(planned):
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
            whole = [all(bool(share[-1, row]) for share in shares) for row in range(len(planned))]
            missing = whole.count(False)
            if missing:
                self.manager.counters.add("write_back.incomplete", missing)
            self._store(
                [
                    Saving(spec, index, key, content_key, self._assembler(key, [share[row] for share in shares]))
                    for row, (spec, index, key, content_key) in enumerate(planned)
                    if whole[row]
                ]
            )

        self.saves.submit(travel, nbytes)

    def _assembler(self, key: uuid.UUID, shares: list[torch.Tensor]) -> Callable[[torch.Tensor], BlockChecksum]:
        layout, hasher = self.layout, self.manager.target.hasher

        def fill(block: torch.Tensor) -> BlockChecksum:
            self.shard.assemble(layout, block, shares)
            checksum = hasher.checksum(key, block, layout)
            assert isinstance(checksum, BlockChecksum)  # a whole block
            return checksum

        return fill

    def _filler(self, key: uuid.UUID, index: int, pages: list[int]) -> Callable[[torch.Tensor], BlockChecksum]:
        paged, layout = self.paged, self.layout
        assert paged is not None
        hasher = self.manager.target.hasher  # the write-back tier's hasher

        def fill(block: torch.Tensor) -> BlockChecksum:
            paged.gather(block, index=index, pages=pages)
            checksum = hasher.checksum(key, block, layout)
            assert isinstance(checksum, BlockChecksum)  # a whole block
            return checksum

        return fill

    def take_finished(self) -> set[str]:
        """The requests whose asynchronous load ended since the last call: loaded, failed, or given
        up at its deadline. The pages of a load that did not complete are recomputed (reported by
        `take_invalid` in the same step, which vLLM reads after this)."""
        ended, self.refused_async = self.refused_async, set()
        for spec, report in self.async_loads.settle(self.manager, invalidate=self._invalidate):
            ended.add(spec.request_id)
            self.report.loads[spec.request_id] = report
        return ended

    def take_invalid(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Wait until every block handed to the save queue is stored (False: not by `timeout`)."""
        return self.saves.drain(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what the save queue still holds (up to `timeout`), then stop its thread."""
        self.saves.close(timeout)

    def take_report(self) -> StrataWorkerMeta | None:
        report, self.report = self.report, StrataWorkerMeta()
        with self._saved_lock:
            saved, self._saved = self._saved, collections.Counter()
        for request_id, count in saved.items():  # stored since the last report, by either path
            report.saved[request_id] = report.saved.get(request_id, 0) + count
        report.counts = _delta(self.manager.counters.snapshot(), self._shipped_counts)
        report.store_events = _delta(self.manager.store.stats(), self._shipped_events)
        if not (
            report.loads
            or report.saved
            or report.prefills_done
            or report.prefill
            or report.counts
            or report.store_events
        ):
            return None
        return report


def _delta(now: dict[str, int], shipped: dict[str, int]) -> dict[str, int]:
    """What grew since `shipped` (which becomes `now`)."""
    grown = {name: value - shipped.get(name, 0) for name, value in now.items() if value != shipped.get(name, 0)}
    shipped.clear()
    shipped.update(now)
    return grown
