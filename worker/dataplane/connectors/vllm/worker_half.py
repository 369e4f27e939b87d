"""The connector's worker half: moves the bytes between vLLM's pages and Strata's tiers.

start_load_kv: the step's loads are read layer by layer (layer 0 of every hit block, then layer
1, ...) into staging memory bounded by `load_staging_bytes` (`connectors.staging`: a load larger
than it goes in pieces); wait_for_layer_load(layer) waits for that layer's pieces only and
scatters each into vLLM's pages (one copy); the wait is the layer's stall. A block read from L3
must carry the checksum the scheduler half's directory lookup registered for it
(`LoadSpec.checksums`).
save_kv_layer / wait_for_save: the new full blocks are copied out of the pages inside the step
and stored and registered outside it (`saving.BlockSaves`).
A load that failed (a block corrupt or vanished, a tier past its deadline, an error of ours)
reports its pages (get_block_ids_with_load_errors): vLLM recomputes them. No block computed over
such a page is stored (`failed_pages`). An error part-way through a step's loads fails every load
of the step that is not known to be whole, the asynchronous ones included, so that no page
promised to vLLM is left unfilled and unreported, and no request waits for a load forever.
build_connector_worker_meta: what the step measured (stalls, tier speeds, prefill speed,
counters) and, where vLLM publishes KV events, the copies stored and dropped since (`kv_events`),
back to the scheduler half.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import torch

from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.staging import LoadKeys, StagedLoads, slot_blocks
from worker.dataplane.connectors.vllm.async_loads import AsyncLoads, scatter_piece
from worker.dataplane.connectors.vllm.blend_load import BlendLoads, BlendUnavailable
from worker.dataplane.connectors.vllm.failed_pages import FailedPages
from worker.dataplane.connectors.vllm.kv_events import TierChanges
from worker.dataplane.connectors.vllm.metadata import (
    LoadReport,
    LoadSpec,
    SaveSpec,
    StrataMetadata,
    StrataWorkerMeta,
)
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.saving import BlockSaves, CudaStreams
from worker.dataplane.connectors.vllm.sharding import Gather, Shard
from worker.dataplane.layout import block_layout
from worker.dataplane.prefix.cache import LoadFailed

log = logging.getLogger("strata.vllm")


@dataclasses.dataclass
class ActiveLoad:
    spec: LoadSpec
    index: int
    """The load's place among the step's staged loads."""
    stalls: list[float]
    failure: LoadFailed | None = None
    scattered: int = 0


class WorkerHalf:
    """Moves the bytes: loads into vLLM's pages layer by layer (or outside the step, for the
    slower tiers: `AsyncLoads`), and copies the full blocks a step completes out of them
    (`BlockSaves`)."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        layerwise_saves: bool | None = None,
        shard: Shard | None = None,
        gather: Gather | None = None,
        changes: TierChanges | None = None,
        streams: CudaStreams | None = None,
    ) -> None:
        self.runtime = runtime
        self.layout = block_layout(runtime.profile)
        self.shard = shard or Shard(rank=0, ranks=1, kv_heads=self.layout.kv_heads)
        if not self.shard.whole and gather is None:
            raise ValueError("a tensor-parallel worker half needs the gather over its ranks")
        self.share_layout = self.shard.layout(self.layout)
        """What this rank's pages hold of a block: its kv heads of its stage's layers."""
        self.layers = self.shard.layers(self.layout)
        """The layers this rank's pages hold (a pipeline stage's own), by their index in the model."""
        slot_blocks(self.layout, runtime.config.load_staging_bytes, 1)  # refuses a budget too small to load
        self.manager = runtime.manager
        self.changes = changes
        """The copies the manager stores and drops, for vLLM's KV events (None: not published)."""
        if changes is not None:
            self.manager.copies = changes
        self.saves = BlockSaves(
            self.manager,
            layout=self.layout,
            shard=self.shard,
            gather=gather,
            budget=runtime.config.save_staging_bytes,
            deadline_s=runtime.config.load_deadline_seconds,
            layerwise=layerwise_saves,
            streams=streams,
        )
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
        """Asynchronous loads refused by the scheduler, or never started: finished (failed) at once."""
        self.blends = BlendLoads(
            self.manager.store, self.layout, self.manager.counters, verify=self.manager.verifies_remote
        )
        self.invalid: set[int] = set()
        self.failed: FailedPages | None = None
        """The pages loads failed to fill, until a plan made after their report (once registered)."""
        self.step = 0
        """The step being run (`StrataMetadata.step`)."""
        self.report = StrataWorkerMeta()
        self.step_started = 0.0
        self._shipped_counts: dict[str, int] = {}
        self._shipped_events: dict[str, int] = {}

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layouts: Mapping[str, str],
        layer_index: Callable[[str], int],
        *,
        block_size: int | None = None,
    ) -> None:
        """vLLM's KV tensors, by layer name, and each one's page layout (`pages.layout_of`).
        `block_size`: the tokens of a page as vLLM's scheduler counts them (its cache config),
        which the tensors' pages must hold: a page table read with another page size would put
        every token in the wrong place."""
        names = sorted(kv_caches, key=layer_index)
        if [layer_index(name) for name in names] != list(self.layers):
            raise ValueError(
                f"StrataConnector: this rank's KV caches are of layers {[layer_index(name) for name in names]}, "
                f"its pipeline stage holds layers {self.layers.start}..{self.layers.stop - 1}"
            )
        kinds = {layouts[name] for name in names}
        if len(kinds) != 1:
            raise ValueError(f"StrataConnector: the layers' pages are laid out differently ({sorted(kinds)})")
        paged = PagedKV([kv_caches[name] for name in names], kind=kinds.pop(), layout=self.share_layout)
        if block_size is not None and paged.page_tokens != block_size:
            raise ValueError(
                f"StrataConnector: the registered KV tensors hold pages of {paged.page_tokens} tokens, vLLM's "
                f"block_size is {block_size}: their pages must be the same size"
            )
        self.paged = paged
        self.failed = FailedPages(pages_per_block=paged.pages_per_block)
        self.layer_of = {name: layer_index(name) for name in names}
        self.saves.attach(self.paged)
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
        self.step = meta.step
        if self.failed is not None:
            self.failed.acknowledged(meta.reported)
        self.saves.begin()
        self.step_started = time.perf_counter()
        self.settled: set[str] = set()
        """The step's loads whose outcome is reported (refused, failed or settled)."""
        for request_id in meta.aborted:
            if self.async_loads.give_up(request_id, "the request ended while its load ran"):
                log.info("request %s ended while its load ran: the load is given up", request_id)

    def start_loads(self) -> None:
        """Start the step's loads: the asynchronous ones on threads of their own, the others
        staged layer by layer for `wait_layer`. Any error part-way fails every load of the step
        not known to be whole (`abandon_loads`)."""
        meta, paged = self.meta, self.paged
        if meta is None or paged is None:
            return
        self.blends.checks.judge_pending()  # a sampled blended load of an earlier step, before this one's
        try:
            self._start(meta, paged)
        except Exception as exc:  # noqa: BLE001 - never an engine error: the step's loads are recomputed
            log.exception("this step's loads could not start; vLLM recomputes them")
            self.abandon_loads(exc)

    def _start(self, meta: StrataMetadata, paged: PagedKV) -> None:
        loads: list[LoadSpec] = []
        for spec in meta.loads:
            if spec.refused:
                log.warning("request %s: load refused (%s); vLLM recomputes its pages", spec.request_id, spec.refused)
                self._report_failure(spec, spec.refused)
            elif spec.asynchronous:
                self.async_loads.start(spec, paged)
            elif spec.blend is not None:
                self._blend(spec, paged)
            else:
                loads.append(spec)
        if not loads:
            return
        self.deadline = time.perf_counter() + self.runtime.config.load_deadline_seconds
        verify = self.manager.verifies_remote
        self.staged = StagedLoads(
            store=self.manager.store,
            layout=self.layout,
            loads=[LoadKeys(list(spec.keys), list(spec.checksums) if verify else None) for spec in loads],
            budget=self.runtime.config.load_staging_bytes,
            pin=paged.device.type == "cuda",
            layers=self.layers,
        ).start()
        self.loads = [ActiveLoad(spec, index, [0.0] * self.layout.layers) for index, spec in enumerate(loads)]

    def _blend(self, spec: LoadSpec, paged: PagedKV) -> None:
        """A blended load, whole, now (`blend_load`); any failure is reported and vLLM recomputes it."""
        try:
            if not self.shard.whole:
                raise BlendUnavailable("fragment blending serves one rank; this worker is one of several")
            done = self.blends.run(spec, paged)
        except Exception as exc:  # noqa: BLE001 - never an engine error, never half-assembled pages
            log.warning("request %s: blended load failed (%s); vLLM recomputes its tokens", spec.request_id, exc)
            self.manager.counters.add("blend.failures")
            self._report_failure(spec, f"blend: {exc}")
            return
        self.settled.add(spec.request_id)
        self.report.loads[spec.request_id] = LoadReport([], [], done.load_s, [], done.blocks_by_tier)

    def _report_failure(self, spec: LoadSpec, reason: str) -> None:
        """A load of the step that is not read (refused, or given up before it started): its pages
        are reported for vLLM to recompute, and an asynchronous one is reported finished."""
        if spec.request_id in self.settled:
            return
        self.settled.add(spec.request_id)
        self._invalidate(spec)
        self.manager.counters.add("load_failures")
        self.report.loads[spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=reason)
        if spec.asynchronous:
            self.refused_async.add(spec.request_id)

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
        """Layer-wise saves: copy this layer of every block the step completes (`BlockSaves`)."""
        layer = self.layer_of.get(layer_name)
        if self.meta is not None and layer is not None:
            self.saves.save_layer(layer, self.meta.saves)

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
        """Every page the load was to fill: vLLM recomputes from the first of them, and no block
        computed over them is stored (`failed_pages`)."""
        assert self.paged is not None
        n = self.paged.page_tokens
        pages = spec.pages[spec.start // n : -(-spec.end // n)]
        self.invalid.update(pages)
        if self.failed is not None:
            self.failed.failed(self.step, pages)

    def abandon_loads(self, cause: BaseException | None = None) -> None:
        """Give up every load of this step not known to be whole, after an error the loads' own
        handling did not catch: the synchronous ones (started or not) have their pages
        recomputed; the asynchronous ones are given up (started) or reported finished at once
        (not started), so that no request waits for them."""
        reason = f"the step's loads were given up: {cause}" if cause is not None else "the step's loads were given up"
        for load in self.loads:
            if load.failure is None:
                load.failure = LoadFailed(0, 0, RuntimeError(reason))
                self._invalidate(load.spec)
                self.manager.counters.add("load_failures")
        if self.staged is not None:
            self.staged.stop()
        meta = self.meta
        if meta is None:
            return
        active = {load.spec.request_id for load in self.loads}
        for spec in meta.loads:
            if spec.request_id in active or spec.refused:
                continue
            if spec.asynchronous and self.async_loads.give_up(spec.request_id, reason):
                continue  # reported with its pages when it ends (`take_finished`)
            self._report_failure(spec, reason)

    def finish_step(self) -> None:
        """After the forward pass: settle the loads, then save the step's new full blocks but those
        computed over a page a failed load left. Under tensor parallel the saves run whatever the
        loads did (every rank must reach the gather)."""
        meta = self.meta
        if meta is None:
            return
        try:
            self._settle_step()
        except Exception as exc:  # noqa: BLE001 - loads not known to be whole are recomputed
            log.exception("this step's loads could not be settled; vLLM recomputes them")
            self.abandon_loads(exc)
            self.loads, self.staged = [], None
        finally:
            self.saves.finish(meta.saves, self._poisoned)
        forward_s = time.perf_counter() - self.step_started
        if not meta.loads and meta.scheduled_tokens >= self.layout.block_tokens:
            self.report.prefill = (meta.scheduled_tokens, forward_s)
        self.report.prefills_done.extend(meta.prefills_done)

    def _poisoned(self, spec: SaveSpec, index: int) -> bool:
        return self.failed is not None and self.failed.poisons(spec.pages, index)

    def _settle_step(self) -> None:
        loads, staged = self.loads, self.staged
        if staged is not None and not staged.join(timeout=max(0.0, self.deadline - time.perf_counter())):
            log.warning("a tier has not answered this step's loads by their deadline; their pages are recomputed")
        for load in loads:
            try:
                assert staged is not None
                self._settle(load, staged, first=load is loads[0])
            except Exception as exc:  # noqa: BLE001 - a load not known to be whole is recomputed
                log.exception("request %s: its load could not be settled; vLLM recomputes it", load.spec.request_id)
                load.failure = load.failure or LoadFailed(0, 0, exc)
                self._invalidate(load.spec)
                self.manager.counters.add("load_failures")
                self.report.loads[load.spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=str(exc))
            self.settled.add(load.spec.request_id)
        self.loads, self.staged = [], None

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

    def take_finished(self) -> set[str]:
        """The requests whose asynchronous load ended since the last call: loaded, failed, or given
        up at its deadline. The pages of a load that did not complete are recomputed (reported by
        `take_invalid` in the same step, which vLLM reads after this)."""
        ended, self.refused_async = self.refused_async, set()
        try:
            settled = self.async_loads.settle(self.manager, invalidate=self._invalidate)
        except Exception as exc:  # noqa: BLE001 - no request may wait for a load forever
            log.exception("the asynchronous loads could not be settled; vLLM recomputes every one of them")
            settled = self.async_loads.give_up_all(self.manager, invalidate=self._invalidate, cause=exc)
        for spec, report in settled:
            ended.add(spec.request_id)
            self.report.loads[spec.request_id] = report
        return ended

    def take_invalid(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    @property
    def layerwise_saves(self) -> bool | None:
        """Whether blocks are copied layer by layer (on a GPU) or after the step (`BlockSaves`)."""
        return self.saves.layerwise

    @layerwise_saves.setter
    def layerwise_saves(self, layerwise: bool) -> None:
        self.saves.layerwise = layerwise

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Wait until every block handed to the save queue is stored (False: not by `timeout`)."""
        return self.saves.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what the save queue still holds (up to `timeout`), then stop its thread."""
        self.saves.close(timeout)

    def take_report(self) -> StrataWorkerMeta | None:
        report, self.report = self.report, StrataWorkerMeta()
        report.step = self.step
        for request_id, count in self.saves.take_saved().items():  # stored since the last report, by either path
            report.saved[request_id] = report.saved.get(request_id, 0) + count
        report.counts = _delta(self.manager.counters.snapshot(), self._shipped_counts)
        report.store_events = _delta(self.manager.store.stats(), self._shipped_events)
        if self.changes is not None:
            report.tier_changes = self.changes.take()
        report.blend_samples = self.blends.checks.take()
        if not (
            report.loads
            or report.saved
            or report.prefills_done
            or report.prefill
            or report.counts
            or report.store_events
            or report.tier_changes
            or report.blend_samples
        ):
            return None
        return report


def _delta(now: dict[str, int], shipped: dict[str, int]) -> dict[str, int]:
    """What grew since `shipped` (which becomes `now`)."""
    grown = {name: value - shipped.get(name, 0) for name, value in now.items() if value != shipped.get(name, 0)}
    shipped.clear()
    shipped.update(now)
    return grown
