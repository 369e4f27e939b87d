"""The connector's scheduler half: what each request can load from Strata and what each step saves.

get_num_new_matched_tokens: fingerprint the request (our chained keys, salted with its
namespace's salt, scoped by its LoRA adapter and cache salt: `requests`; the namespace from an
identity the operator controls: `tenancy`), find its blocks in the node's tiers, then with one
batched directory lookup; answer None ("ask again next step") while that lookup is in flight,
so the scheduler loop never waits on the database. The offload manager decides load or
recompute. A request Strata cannot key (prompt embeddings, multimodal inputs, a field it does
not know, an adapter it cannot read) is served uncached and counted.
update_state_after_alloc: the pages a synchronous load fills (and every later page of the
request) are taken out of vLLM's prefix cache at once, and put back once the worker reports the
load whole (`shared_pages`): until then no other request may be handed pages a failed load would
leave wrong (`failed_pages` says why this keeps every failure to the request that loaded).
Asynchronous loads need nothing: vLLM caches their pages only once they are loaded.
build_connector_meta: per scheduled request, the blocks to load this step (tokens, keys,
tiers, pages) and the full blocks its step completes, to save; each step numbered, with the last
step whose report was read when it was planned. Each request's part is built on
its own: a request whose part fails loses its own saves, and a load vLLM was promised is
always handed over, if need be as a refused one, so that the worker reports its pages and
vLLM recomputes them (pages promised and never filled would be served as they are).
update_connector_output: the worker's step report folds into the request timelines and the
speed estimates; the timelines and the metrics are served by `connectors.status`, the counters
also on vLLM's /metrics (`stats`), the copies the worker stored and dropped as vLLM's KV events
(`kv_events`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request as VllmRequest

from worker.dataplane.connectors.status import StatusServer
from worker.dataplane.connectors.vllm.fragments import WAIT, FragmentFinder
from worker.dataplane.connectors.vllm.kv_events import BlockEvents
from worker.dataplane.connectors.vllm.lookups import Blend, Lookups, Plan, Tracked
from worker.dataplane.connectors.vllm.metadata import (
    LoadSpec,
    SaveSpec,
    StrataMetadata,
    StrataWorkerMeta,
)
from worker.dataplane.connectors.vllm.requests import (
    AdapterDigests,
    uncached_reason,
    unknown_fields,
)
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.shared_pages import LoadedPages
from worker.dataplane.connectors.vllm.stats import FollowedGauges, StatsTap, merged
from worker.dataplane.connectors.vllm.tenancy import NamespacePolicy, Unplaced
from worker.dataplane.counters import Counters
from worker.dataplane.directory import DirectoryUnavailable
from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter
from worker.dataplane.offload_records import Decision, RequestTrace, TierLoad
from worker.dataplane.tier_names import DISK, HOST, REMOTE

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("strata.vllm")

HIT_SOURCES = {HOST: CacheHitSource.HOST, DISK: CacheHitSource.DISK, REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
"""vLLM's name for the tier that served a hit (it has none for a distributed store)."""


class SchedulerHalf:
    """Decides, per request, what vLLM can load from Strata and what to save."""

    def __init__(self, runtime: Runtime, *, page_tokens: int, events: BlockEvents | None = None) -> None:
        self.runtime = runtime
        self.manager = runtime.manager
        self.block_tokens = runtime.profile.block_tokens
        if self.block_tokens % page_tokens:
            raise ValueError(
                f"StrataConnector: vLLM's block size {page_tokens} must divide Strata's block_tokens "
                f"{self.block_tokens}"
            )
        self.policy = NamespacePolicy(
            default_namespace=runtime.config.default_namespace,
            client_namespaces=runtime.config.client_namespaces,
            namespace_secret=runtime.config.namespace_secret,
            placed=bool(runtime.config.api_keys or runtime.config.namespace_header),
        )
        self.adapters = AdapterDigests()
        self.unknown_fields = frozenset(unknown_fields(VllmRequest))
        if self.unknown_fields:
            log.warning(
                "StrataConnector: vLLM's requests carry fields Strata does not key (%s); a request that sets one "
                "is served uncached",
                ", ".join(sorted(self.unknown_fields)),
            )
        self.requests: dict[str, Tracked] = {}
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=200)
        self.lookups = Lookups(self.manager, self.adapters, uncached=self._uncached)
        self.worker_store_events = Counters()
        self.metrics = EngineMetrics(
            self.manager,
            runtime.config.node_name,
            model=runtime.profile.model_id,
            store_events=self.worker_store_events,
        )
        self.metrics.registry.register(FollowedGauges(runtime.config.node_name, self._followed))
        self.stats = StatsTap(
            merged(self.manager.counters.snapshot, self.manager.store.stats, self.worker_store_events.snapshot),
            block_tokens=self.block_tokens,
        )
        """What vLLM's /metrics shows of the counters (vLLM takes it after each step)."""
        self.events = events
        """The blocks' payloads and the KV events of the worker's copies (None: vLLM publishes none)."""
        self.server: StatusServer | None = None
        self.async_tiers = frozenset(runtime.config.async_load_tiers)
        self.lookup_deadline_s = runtime.config.lookup_deadline_seconds
        self.async_ready: list[Tracked] = []
        """Requests whose asynchronous load vLLM has made room for: handed to the worker in the next step."""
        self.loaded_pages: LoadedPages | None = None
        """vLLM's prefix cache as synchronous loads use it (None until vLLM binds its KV cache
        manager: till then every load runs asynchronously)."""
        self.page_tokens = page_tokens
        self.step = 0
        """The last step planned."""
        self.reported = 0
        """The last step whose worker report has been read."""
        self.aborted: list[str] = []
        """Requests that ended while their asynchronous load runs, for the next step's worker."""
        self.fragments: FragmentFinder | None = None
        """Fragment reuse (`fragments`), where the node blends and vLLM's model can be blended."""

    def serve_status(self, *, data_parallel_rank: int = 0) -> None:
        """Serve the status endpoints: on the node's status port, plus the data-parallel rank (each
        rank of a data-parallel server runs a scheduler of its own, beside the others)."""
        config = self.runtime.config
        self.server = StatusServer(
            metrics=self.metrics,
            traces=lambda: list(self.traces),
            node=config.node_name,
            host=config.serve_host,
            port=config.node_status_port + data_parallel_rank,
            admin_key=config.node_admin_key,
        ).start()

    def _followed(self) -> tuple[int, int, int]:
        """(requests followed, lookups in flight, policy version in force), for the status gauges."""
        tracked = list(self.requests.values())
        return len(tracked), sum(1 for t in tracked if t.pending is not None), self.runtime.policy_version

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.lookups.close()
        if self.fragments is not None:
            self.fragments.close()

    # -- lookups ---------------------------------------------------------------------------------
    def _track(self, request: Request) -> Tracked:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            trace = RequestTrace(
                request_id=request.request_id,
                namespace="",
                prompt_tokens=request.num_prompt_tokens,
                started_at=float(request.arrival_time),
            )
            namespace: str | None = None
            reason = uncached_reason(request, self.unknown_fields)
            if not reason:
                try:
                    namespace = self.policy.namespace_of(request.kv_transfer_params)
                except Unplaced as exc:
                    log.info("request %s runs without the cache: %s", request.request_id, exc)
                    reason = "unplaced"
                except ValueError as exc:
                    log.warning("request %s runs without the cache: %s", request.request_id, exc)
                    reason = "namespace"
            if reason:
                self._uncached(trace, reason)
            trace.namespace = namespace or ""
            tracked = Tracked(request=request, namespace=namespace, trace=trace)
            self.requests[request.request_id] = tracked
        return tracked

    def _uncached(self, trace: RequestTrace, reason: str) -> None:
        """Serve the request without the cache, and count why."""
        log.debug("request %s is served uncached: %s", trace.request_id, reason)
        trace.uncached = reason
        self.manager.counters.add(f"uncached.{reason}")

    def matched_tokens(self, request: Request, computed: int) -> int | None:
        """Tokens beyond `computed` (vLLM's own prefix cache) that Strata can load; None while the
        lookup is still running."""
        tracked = self._track(request)
        if tracked.namespace is None or tracked.recompute:
            tracked.asynchronous = False
            return 0
        if tracked.scheduled:
            # Preempted and back: its pages are gone and its tokens grew; look it up anew.
            tracked.plan, tracked.scheduled, tracked.load, tracked.load_tokens = None, False, None, 0
            tracked.blend, tracked.blend_checked, tracked.blend_search = None, False, None
        if tracked.plan is None:
            if tracked.pending is None:
                tracked.pending_since = time.perf_counter()
                tracked.pending = self.lookups.start(tracked)
            if not tracked.pending.done():
                waited = time.perf_counter() - tracked.pending_since
                if waited < self.lookup_deadline_s:
                    return None
                # No answer in time: the request recomputes, as when the directory is down.
                log.warning(
                    "request %s: no lookup answer within lookup_deadline_seconds (%g s); served without the "
                    "cache", request.request_id, self.lookup_deadline_s)  # fmt: skip
                self.manager.counters.add("lookup_deadlines")
                tracked.pending = None
                tracked.plan = Plan([], 0, [], Decision("no-hit"), waited)
                self._record_plan(tracked)
                return 0
            tracked.plan, tracked.pending = tracked.pending.result(), None
            self._record_plan(tracked)
            if tracked.namespace is None:  # found unkeyable on the way (an adapter it cannot read)
                return 0
        hit_tokens = self._hit_end(tracked)
        blend = None
        if self.fragments is not None and self.loaded_pages is not None:  # blended loads run inside the step
            found = self.fragments.for_request(tracked, exact=max(computed, hit_tokens))
            if found == WAIT:  # its fragments are being looked for in the directory
                return None
            blend = found if isinstance(found, Blend) else None
        if blend is not None and blend.end > computed:
            tracked.hit_end = blend.end
            tracked.local_tokens = computed
            tracked.asynchronous = False  # assembled inside the step, before the forward pass
            return blend.end - computed
        external = max(0, hit_tokens - computed)
        tracked.hit_end = hit_tokens
        tracked.local_tokens = computed
        loaded = tracked.plan.hits[computed // self.block_tokens : -(-hit_tokens // self.block_tokens)]
        tracked.asynchronous = external > 0 and (
            self.loaded_pages is None or any(hit.tier in self.async_tiers for hit in loaded)
        )
        return external

    def _hit_end(self, tracked: Tracked) -> int:
        """Where the tokens Strata can load end: its held blocks, short of the prompt's last token
        (computed, to sample the next one)."""
        assert tracked.plan is not None
        return min(len(tracked.plan.hits) * self.block_tokens, tracked.request.num_tokens - 1)

    def asynchronous(self, request: Request) -> bool:
        """Whether the load `matched_tokens` just offered runs outside the engine step."""
        tracked = self.requests.get(request.request_id)
        return tracked is not None and tracked.asynchronous

    def _record_plan(self, tracked: Tracked) -> None:
        plan = tracked.plan
        assert plan is not None
        tracked.fingerprints = plan.fingerprints
        tracked.stored = plan.held
        tracked.trace.decision = plan.decision.choice
        tracked.trace.lookup_s = plan.lookup_s
        self.manager.counters.add("lookup_tokens", tracked.request.num_tokens)

    def bind_prefix_cache(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM's KV cache manager: from now on a load may run inside the engine step."""
        self.loaded_pages = LoadedPages(kv_cache_manager, page_tokens=self.page_tokens)

    def allocated(self, request: Request, external: int, pages: Sequence[int] = ()) -> None:
        """vLLM made room for the request's load in its pages `pages`: an asynchronous load starts
        at once (the request waits meanwhile); a synchronous one runs in the request's next step
        (`_step`), and its pages leave vLLM's prefix cache until it is reported whole."""
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            return
        tracked.load_tokens = external
        if external <= 0:
            return
        if tracked.asynchronous:
            tracked.pages = list(pages)
            self.async_ready.append(tracked)
        else:
            assert self.loaded_pages is not None
            tracked.unshared = (tracked.local_tokens // self.page_tokens, list(pages))
            tracked.blended = tracked.blend is not None and tracked.hit_end == tracked.blend.end
            self.loaded_pages.unshare(pages, tracked.unshared[0])

    def hit_sources(self, request: Request, external: int) -> dict[CacheHitSource, int]:
        tracked = self.requests.get(request.request_id)
        if tracked is None or tracked.plan is None or external <= 0:
            return {}
        sources: collections.Counter[CacheHitSource] = collections.Counter()
        end = self._hit_end(tracked)
        start = end - external
        for hit in tracked.plan.hits:
            lo, hi = max(start, hit.index * self.block_tokens), min(end, (hit.index + 1) * self.block_tokens)
            if hi > lo:
                sources[HIT_SOURCES.get(hit.tier, CacheHitSource.EXTERNAL_UNSPECIFIED)] += hi - lo
        return dict(sources)

    # -- each step -------------------------------------------------------------------------------
    def _numbered(self, output: SchedulerOutput) -> StrataMetadata:
        """A new step's work, numbered, with the last step whose report this plan has read and the
        requests whose asynchronous loads to give up."""
        self.step += 1
        aborted, self.aborted = self.aborted, []
        return StrataMetadata(
            scheduled_tokens=output.total_num_scheduled_tokens, step=self.step, reported=self.reported, aborted=aborted
        )

    def build(self, output: SchedulerOutput) -> StrataMetadata:
        meta = self._numbered(output)
        ready, self.async_ready = self.async_ready, []
        for waiting in ready:
            if waiting.request.is_finished():
                spec = self._refused_load(waiting, waiting.hit_end, "the request ended before its load started")
            else:
                try:
                    spec = self._load(waiting, waiting.hit_end)
                except Exception as exc:  # noqa: BLE001 - the request waits for its load: always hand one over
                    log.exception(
                        "request %s: its load could not be planned; vLLM recomputes it", waiting.request.request_id
                    )
                    spec = self._refused_load(waiting, waiting.hit_end, f"load not planned: {exc}")
            spec.asynchronous = True
            meta.loads.append(spec)
            waiting.load_tokens = 0
            waiting.loading = True
        for new in output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                tracked.pages = list(new.block_ids[0])
                self._step(tracked, new.num_computed_tokens, output.num_scheduled_tokens[new.req_id], meta)
        cached = output.scheduled_cached_reqs
        # vLLM 0.32-0.33 resume a preempted request among the cached ones (its pages anew); 0.34
        # sends it with the new requests, whole page table included, and has no resumed_req_ids.
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in resumed:
                tracked.pages = list(added[0]) if added is not None else []
            elif added is not None:
                tracked.pages.extend(added[0])
            self._step(tracked, cached.num_computed_tokens[i], output.num_scheduled_tokens[req_id], meta)
        return meta

    def refused(self, output: SchedulerOutput, reason: str) -> StrataMetadata:
        """The step's work when building it failed as a whole: every load promised to a request
        scheduled in it, refused, so that the worker reports their pages and vLLM recomputes them."""
        meta = self._numbered(output)
        ready, self.async_ready = self.async_ready, []
        for waiting in ready:  # waiting for their loads: refused, so that the worker reports them ended
            spec = self._refused_load(waiting, waiting.hit_end, reason)
            spec.asynchronous = True
            meta.loads.append(spec)
            waiting.load_tokens = 0
            waiting.loading = True
        scheduled = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed in scheduled:
            tracked = self.requests.get(req_id)
            if tracked is not None and tracked.load_tokens > 0:
                meta.loads.append(self._refused_load(tracked, computed, reason))
        return meta

    def _step(self, tracked: Tracked, computed: int, scheduled: int, meta: StrataMetadata) -> None:
        """One request's part of the step: its load (always handed over when one was promised),
        its saves, its prefill's end. A failure loses the request's own saves, nothing else."""
        if not tracked.scheduled:
            tracked.scheduled = True
            tracked.first_step_at = time.time()
            tracked.trace.cached_tokens = computed  # vLLM's own prefix cache and what Strata loads
        if tracked.load_tokens > 0:
            try:
                meta.loads.append(self._load(tracked, computed))
            except Exception as exc:  # noqa: BLE001 - the promised pages are recomputed, never left unfilled
                log.exception(
                    "request %s: its load could not be planned; vLLM recomputes it", tracked.request.request_id
                )
                meta.loads.append(self._refused_load(tracked, computed, f"load not planned: {exc}"))
            tracked.load_tokens = 0
        try:
            self._saves(tracked, computed, scheduled, meta)
        except Exception:  # noqa: BLE001 - blocks not saved are a future miss, never another request's loss
            log.exception("request %s: this step's blocks are not saved", tracked.request.request_id)
            self.manager.counters.add("write_back.unplanned")
        request = tracked.request
        if not tracked.prefilled and min(computed + scheduled, request.num_tokens) >= request.num_prompt_tokens:
            tracked.prefilled = True
            meta.prefills_done.append(request.request_id)

    def _load(self, tracked: Tracked, computed: int) -> LoadSpec:
        """The load vLLM was promised for this request (its tokens before `computed` that vLLM's
        own cache does not hold), as a spec for the worker."""
        request, size = tracked.request, self.block_tokens
        plan, namespace = tracked.plan, tracked.namespace
        if plan is None or namespace is None:
            raise RuntimeError("a load was promised for a request without a plan")
        start, end = computed - tracked.load_tokens, computed
        if tracked.blended:
            assert self.fragments is not None
            return self.fragments.load(tracked, start, end)
        first, last = start // size, -(-end // size)
        hits = plan.hits[first:last]
        if len(hits) != last - first:
            raise RuntimeError(f"tokens {start}..{end} need blocks {first}..{last}, the plan holds {len(plan.hits)}")
        tracked.load = LoadSpec(
            request_id=request.request_id,
            namespace=namespace,
            keys=[h.key for h in hits],
            tiers=[h.tier for h in hits],
            checksums=[h.checksum for h in hits],
            first_block=first,
            start=start,
            end=end,
            pages=list(tracked.pages),
        )
        tracked.trace.prefix_tokens = end - start
        tracked.trace.hit_blocks_by_tier = dict(collections.Counter(h.tier for h in hits))
        self.manager.touch_hits(namespace, hits)
        return tracked.load

    def _refused_load(self, tracked: Tracked, computed: int, reason: str) -> LoadSpec:
        """A load the worker does not read but reports as failed: its pages are recomputed."""
        start, end = computed - tracked.load_tokens, computed
        tracked.load = LoadSpec(
            request_id=tracked.request.request_id,
            namespace=tracked.namespace or "",
            keys=[],
            tiers=[],
            checksums=[],
            first_block=start // self.block_tokens,
            start=start,
            end=end,
            pages=list(tracked.pages),
            refused=reason,
        )
        return tracked.load

    def _saves(self, tracked: Tracked, computed: int, scheduled: int, meta: StrataMetadata) -> None:
        """The full blocks this step completes that are not stored yet."""
        request, size = tracked.request, self.block_tokens
        full = min(computed + scheduled, request.num_tokens) // size
        if tracked.saves_until is not None:
            full = min(full, tracked.saves_until)
        if tracked.namespace is None or full <= tracked.stored:
            return
        fingerprints = self._fingerprints(tracked, full)
        if fingerprints is None:
            return
        blocks = fingerprints[tracked.stored : full]
        meta.saves.append(
            SaveSpec(
                request_id=request.request_id,
                namespace=tracked.namespace,
                pages=list(tracked.pages),
                blocks=[(fp.index, fp.prefix_key, fp.content_key) for fp in blocks],
            )
        )
        if self.events is not None:
            self.events.planned(request, blocks)
        if self.fragments is not None:
            self.fragments.remember(blocks)
        tracked.stored = full

    def _fingerprints(self, tracked: Tracked, blocks: int) -> list[BlockFingerprint] | None:
        """The request's first `blocks` block keys (its output tokens too, as they grow)."""
        have = tracked.fingerprints
        if len(have) < blocks:
            assert tracked.namespace is not None
            if tracked.scope is None:  # its lookup has not run: its keys are not known yet
                return None
            try:
                fingerprinter = self.manager.fingerprinter(tracked.namespace, tracked.scope)
            except DirectoryUnavailable as exc:
                log.warning("request %s: blocks not saved: %s", tracked.request.request_id, exc)
                return None
            tokens = list(tracked.request.all_token_ids)
            have.extend(_continue(fingerprinter, have, tokens, blocks))
        return have

    def update(self, output: KVConnectorOutput) -> None:
        """Fold one step's worker report into the request timelines and the estimates."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, StrataWorkerMeta):
            return
        self.reported = max(self.reported, meta.step)
        now = time.time()
        manager = self.manager
        for name, count in meta.counts.items():
            manager.counters.add(name, count)
        for name, count in meta.store_events.items():
            self.worker_store_events.add(name, count)
        if meta.prefill is not None:
            manager.observe_prefill(*meta.prefill)
        if self.events is not None:
            self.events.reported(meta.tier_changes)
        if self.fragments is not None:
            for namespace, percent, agreed, kl in meta.blend_samples:
                self.fragments.tuner.record(namespace, agree=agreed, kl=kl, percent=percent)
        for request_id, report in meta.loads.items():
            manager.observe_load(TierLoad(tier, nbytes, seconds) for tier, nbytes, seconds in report.tier_loads)
            if not report.failure:
                self.stats.loaded(report.load_s, report.stalls)
            tracked = self.requests.get(request_id)
            if tracked is not None:
                tracked.loading = False
                unshared, tracked.unshared = tracked.unshared, None
                if (
                    unshared is not None
                    and not report.failure
                    and not tracked.blended
                    and self.loaded_pages is not None
                ):
                    self.loaded_pages.reshare(tracked.request, unshared[1], unshared[0])
            trace = tracked.trace if tracked is not None else self._finished_trace(request_id)
            if trace is None:
                continue
            trace.layer_stall_s, trace.layer_loaded_at_s, trace.load_s = report.stalls, report.loaded_at, report.load_s
            if report.failure:
                if tracked is not None:
                    # Whatever failed (a bad copy, a tier past its deadline), the request recomputes:
                    # vLLM asks again for a request whose asynchronous load failed, and is told 0.
                    tracked.recompute = True
                if tracked is not None and tracked.load is not None:
                    # vLLM recomputes the loaded range: its blocks are saved again as they complete.
                    tracked.stored = min(tracked.stored, tracked.load.first_block)
                trace.load_failures += 1
                trace.prefix_tokens = 0
                trace.cached_tokens = 0
                trace.hit_blocks_by_tier = {}
        for request_id, count in meta.saved.items():
            trace = self._trace(request_id)
            if trace is not None:
                trace.written_blocks += count
        for request_id in meta.prefills_done:
            tracked = self.requests.get(request_id)
            trace = tracked.trace if tracked is not None else self._finished_trace(request_id)
            if trace is not None and not trace.ttft_s:
                trace.ttft_s = max(0.0, now - trace.started_at)
                if tracked is not None and tracked.first_step_at:
                    trace.prefill_s = max(0.0, now - tracked.first_step_at)

    def _trace(self, request_id: str) -> RequestTrace | None:
        tracked = self.requests.get(request_id)
        return tracked.trace if tracked is not None else self._finished_trace(request_id)

    def _finished_trace(self, request_id: str) -> RequestTrace | None:
        # A step's report can arrive after its request finished (the last step of a short answer).
        for trace in reversed(self.traces):
            if trace.request_id == request_id:
                return trace
        return None

    def finished(self, request: Request) -> None:
        tracked = self.requests.pop(request.request_id, None)
        if tracked is None:
            return
        if tracked.pending is not None:
            tracked.pending.cancel()
        if tracked.blend_search is not None:
            tracked.blend_search.cancel()
        if tracked.loading:  # vLLM frees its pages once the worker reports the load ended
            self.aborted.append(request.request_id)
        trace = tracked.trace
        trace.output_tokens = request.num_output_tokens
        reason = request.get_finished_reason()
        trace.finish_reason = str(reason) if reason is not None else "abort"
        if trace.ttft_s:
            trace.decode_s = max(0.0, time.time() - trace.started_at - trace.ttft_s)
        self.traces.append(trace)


def _continue(
    fingerprinter: Fingerprinter, have: Sequence[BlockFingerprint], tokens: Sequence[int], blocks: int
) -> list[BlockFingerprint]:
    """The keys of blocks len(have) .. blocks - 1 of `tokens`, chained onto `have`."""
    size = fingerprinter.block_tokens
    start = len(have) * size
    more = fingerprinter.blocks(tokens[start : blocks * size], parent=have[-1].prefix_key if have else None)
    return [dataclasses.replace(fp, index=fp.index + len(have), start=fp.start + start) for fp in more]
