"""StrataConnector: vLLM's KV connector (v1) backed by Strata's tiers, directory and offload manager.

vLLM runs the connector twice, in two processes: the scheduler's half decides what each request
can load, the worker's half moves the bytes while the model computes.

    scheduler  get_num_new_matched_tokens: fingerprint the request (our chained, salted keys; the
               namespace from kv_transfer_params' strata_namespace, else cache_salt, else
               default), find its blocks in the node's tiers, then with one batched directory
               lookup; answer None ("ask again next step") while that lookup is in flight, so the
               scheduler loop never waits on the database. The offload manager decides load or
               recompute.
               build_connector_meta: per scheduled request, the blocks to load this step (tokens,
               keys, tiers, pages) and the full blocks its step completes, to save.
    worker     start_load_kv: one layer-wise loader per request (layer 0 of every hit block, then
               layer 1, ...); wait_for_layer_load(layer) waits for that layer only, then scatters
               it into vLLM's pages (one copy); the wait is the layer's stall.
               wait_for_save: the new full blocks, gathered from the pages straight into the
               write-back tier (the host pool's slot: one copy, then hashed), registered in one
               batch behind the request path. A load that failed (a block corrupt or vanished)
               reports its pages (get_block_ids_with_load_errors): vLLM recomputes them.
               build_connector_worker_meta: what the step measured (stalls, tier speeds, prefill
               speed, counters), back to the scheduler half, which keeps the request timelines
               and serves them with the metrics (connectors.status).

Every hook is guarded: an error inside Strata (database or Redis down, a bug) becomes a miss and
a log line, never an exception in vLLM's engine loop. The engine must run with
kv_load_failure_policy "recompute" (a failed load is recomputed, never served, never fatal) and
one tensor-parallel rank (a block holds every kv head of a layer).

The options are the node's (`dataplane.config`): STRATA_* variables, STRATA_CONFIG_FILE, and the
connector's kv_connector_extra_config, whose keys are option names and take precedence. The
module knows no Django: the directory comes from `open_directory`, which the control plane's
subclass (`worker.vllm_connector.StrataConnector`) provides.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client.core import GaugeMetricFamily
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.config import NodeConfig, load_config
from worker.dataplane.connectors.pages import PagedKV, layout_of
from worker.dataplane.connectors.status import StatusServer
from worker.dataplane.counters import Counters
from worker.dataplane.directory import Directory, DirectoryUnavailable
from worker.dataplane.engine.cache import LoadFailed
from worker.dataplane.engine.loader import LayerLoader, PrefixBuffers
from worker.dataplane.engine.models import checkpoint_profile
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter
from worker.dataplane.layout import ModelProfile
from worker.dataplane.metrics import EngineMetrics
from worker.dataplane.offload import Decision, Hit, OffloadManager, RequestTrace, TierLoad
from worker.dataplane.store import TieredStore, build_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("strata.vllm")

DEFAULT_NAMESPACE = "default"
NAMESPACE_PARAM = "strata_namespace"
"""The key of kv_transfer_params naming a request's namespace (else its cache_salt names it)."""
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}
"""vLLM's name for the tier that served a hit (it has none for a distributed store)."""

VLLM_ONLY_KEYS = frozenset({"shared_storage_path"})
"""kv_connector_extra_config keys other connectors read; not node options, ignored here."""


def namespace_of(request: Request) -> str:
    """The namespace a request's blocks belong to: kv_transfer_params' strata_namespace, else
    its cache_salt, else the default. ValueError naming the value when it is not a namespace name."""
    params = request.kv_transfer_params or {}
    name = params.get(NAMESPACE_PARAM) if isinstance(params, Mapping) else None
    name = name or request.cache_salt or DEFAULT_NAMESPACE
    if not isinstance(name, str) or not _NAMESPACE_RE.match(name):
        raise ValueError(f"namespace {name!r} (kv_transfer_params.{NAMESPACE_PARAM} or cache_salt) must be 1-63 "
                         f"letters, digits, '.', '_' or '-'")
    return name


# -- what the halves tell each other (pickled between the processes) ------------------------------
@dataclasses.dataclass
class LoadSpec:
    """Load tokens [start, end) of a request into its pages: they lie in the blocks `keys`, which
    are the request's blocks first_block, first_block + 1, ... (in `tiers`)."""

    request_id: str
    namespace: str
    keys: list[uuid.UUID]
    tiers: list[str]
    first_block: int
    start: int
    end: int
    pages: list[int]


@dataclasses.dataclass
class SaveSpec:
    """Save full blocks of a request from its pages: (index in the request, prefix key, content key)."""

    request_id: str
    namespace: str
    blocks: list[tuple[int, uuid.UUID, uuid.UUID]]
    pages: list[int]


@dataclasses.dataclass
class StrataMetadata(KVConnectorMetadata):
    """One step's work for the worker half."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    prefills_done: list[str] = dataclasses.field(default_factory=list)
    """Requests whose prefill this step completes (echoed back: their first token is out then)."""
    scheduled_tokens: int = 0


@dataclasses.dataclass
class LoadReport:
    """How one request's load went, as the worker saw it."""

    stalls: list[float]
    loaded_at: list[float]
    load_s: float
    tier_loads: list[tuple[str, int, float]]
    blocks_by_tier: dict[str, int]
    failure: str = ""


@dataclasses.dataclass
class StrataWorkerMeta(KVConnectorWorkerMetadata):
    """One step's results, from the worker half back to the scheduler half."""

    loads: dict[str, LoadReport] = dataclasses.field(default_factory=dict)
    saved: dict[str, int] = dataclasses.field(default_factory=dict)
    prefills_done: list[str] = dataclasses.field(default_factory=list)
    prefill: tuple[int, float] | None = None
    """(tokens, seconds) of a step that loaded nothing: what the prefill speed is learned from."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The worker's counters since its last report (loads, hits, write-back, quarantines)."""
    store_events: dict[str, int] = dataclasses.field(default_factory=dict)
    """Its store's tier events since its last report (corrupt, unavailable, ...)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StrataWorkerMeta):
            return self
        self.loads.update(other.loads)
        for name, count in other.saved.items():
            self.saved[name] = self.saved.get(name, 0) + count
        self.prefills_done.extend(r for r in other.prefills_done if r not in self.prefills_done)
        self.prefill = self.prefill or other.prefill
        for mine, theirs in ((self.counts, other.counts), (self.store_events, other.store_events)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count
        return self


# -- one role's Strata -----------------------------------------------------------------------------
@dataclasses.dataclass
class Runtime:
    """What one half of the connector opens: the node's options, the model's profile, its tiers
    (vLLM's own pages are L1: host, disk and remote here), the directory and the manager."""

    config: NodeConfig
    profile: ModelProfile
    store: TieredStore
    directory: Directory | None
    manager: OffloadManager

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        self.store.close()


def profile_for(vllm_config: VllmConfig, block_tokens: int) -> ModelProfile:
    """The profile of the model vLLM serves, as Strata's own engine would key the same checkpoint."""
    model = vllm_config.model_config
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"StrataConnector: kv cache dtype {vllm_config.cache_config.cache_dtype} is not stored; "
                         f"run with --kv-cache-dtype auto")
    return checkpoint_profile(model.model, dtype=model.dtype, block_tokens=block_tokens)


def check_engine(vllm_config: VllmConfig) -> None:
    """Refuse, by setting, an engine the connector cannot serve correctly."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_load_failure_policy != "recompute":
        raise ValueError('StrataConnector: kv_transfer_config needs "kv_load_failure_policy": "recompute" (a block '
                         f'that fails its checksum is recomputed, never served); it is '
                         f'"{transfer.kv_load_failure_policy}"')
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("StrataConnector: one tensor- and pipeline-parallel rank only (a Strata block holds every "
                         f"kv head of every layer); got tp {parallel.tensor_parallel_size}, "
                         f"pp {parallel.pipeline_parallel_size}")


def node_options(extra: Mapping[str, Any]) -> NodeConfig:
    """The node's options, the connector's extra config first (its keys are option names)."""
    overrides = {key: value for key, value in extra.items() if key not in VLLM_ONLY_KEYS}
    return load_config(overrides=overrides)


# -- the scheduler's half --------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """What a lookup found for a request: its blocks' keys, how many leading blocks some tier
    holds, and the hits the manager decided to load."""

    fingerprints: list[BlockFingerprint]
    held: int
    hits: list[Hit]
    decision: Decision
    lookup_s: float


@dataclasses.dataclass
class Tracked:
    """A request as the scheduler's half follows it, from its first lookup to its end."""

    request: Request
    namespace: str | None
    trace: RequestTrace
    fingerprints: list[BlockFingerprint] = dataclasses.field(default_factory=list)
    plan: Plan | None = None
    pending: Future[Plan] | None = None
    load_tokens: int = 0
    load: LoadSpec | None = None
    stored: int = 0
    """Leading blocks known to be stored (held before, or saved since)."""
    pages: list[int] = dataclasses.field(default_factory=list)
    scheduled: bool = False
    first_step_at: float = 0.0
    prefilled: bool = False


class SchedulerHalf:
    """Decides, per request, what vLLM can load from Strata and what to save."""

    def __init__(self, runtime: Runtime, *, page_tokens: int) -> None:
        self.runtime = runtime
        self.manager = runtime.manager
        self.block_tokens = runtime.profile.block_tokens
        if self.block_tokens % page_tokens:
            raise ValueError(f"StrataConnector: vLLM's block size {page_tokens} must divide Strata's block_tokens "
                             f"{self.block_tokens}")
        self.requests: dict[str, Tracked] = {}
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=200)
        self.lookups = ThreadPoolExecutor(2, thread_name_prefix="strata-lookup")
        self.worker_store_events = Counters()
        self.metrics = EngineMetrics(self.manager, runtime.config.node_name, model=runtime.profile.model_id,
                                     store_events=self.worker_store_events)
        self.metrics.registry.register(_Followed(self))
        self.server: StatusServer | None = None

    def serve_status(self) -> None:
        config = self.runtime.config
        self.server = StatusServer(metrics=self.metrics, traces=lambda: list(self.traces), node=config.node_name,
                                   host=config.serve_host, port=config.node_status_port).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.lookups.shutdown(wait=False, cancel_futures=True)

    # -- lookups ---------------------------------------------------------------------------------
    def _track(self, request: Request) -> Tracked:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            trace = RequestTrace(request_id=request.request_id, namespace="", prompt_tokens=request.num_prompt_tokens,
                                 started_at=float(request.arrival_time))
            namespace: str | None = None
            if request.prompt_token_ids is None or request.mm_features:
                log.debug("request %s: prompt embeddings or media are not cached", request.request_id)
            else:
                try:
                    namespace = namespace_of(request)
                except ValueError as exc:
                    log.warning("request %s runs without the cache: %s", request.request_id, exc)
                    self.manager.counters.add("lookup_failures")
            trace.namespace = namespace or ""
            tracked = Tracked(request=request, namespace=namespace, trace=trace)
            self.requests[request.request_id] = tracked
        return tracked

    def matched_tokens(self, request: Request, computed: int) -> int | None:
        """Tokens beyond `computed` (vLLM's own prefix cache) that Strata can load; None while the
        lookup is still running."""
        tracked = self._track(request)
        if tracked.namespace is None:
            return 0
        if tracked.scheduled:
            # Preempted and back: its pages are gone and its tokens grew; look it up anew.
            tracked.plan, tracked.scheduled, tracked.load, tracked.load_tokens = None, False, None, 0
        if tracked.plan is None:
            if tracked.pending is None:
                tracked.pending = self._start_lookup(tracked)
            if not tracked.pending.done():
                return None
            tracked.plan, tracked.pending = tracked.pending.result(), None
            self._record_plan(tracked)
        hit_tokens = min(len(tracked.plan.hits) * self.block_tokens, request.num_tokens - 1)
        return max(0, hit_tokens - computed)

    def _start_lookup(self, tracked: Tracked) -> Future[Plan]:
        """The lookup, here if it needs no round trip (the salt is known and the node's own tiers
        answer for every block, or there is nothing remote to ask), else on a lookup thread."""
        tokens = list(tracked.request.all_token_ids)
        namespace = tracked.namespace
        assert namespace is not None
        manager = self.manager
        if manager.knows_salt(namespace):
            fingerprints = manager.fingerprints(tokens, namespace)
            found = manager.locate_local([fp.prefix_key for fp in fingerprints])
            if manager.first_miss(fingerprints, found) == len(fingerprints) or "remote" not in manager.store.names:
                done: Future[Plan] = Future()
                done.set_result(self._plan(tracked, fingerprints, found, time.perf_counter()))
                return done
        return self.lookups.submit(self._lookup, tracked, tokens, time.perf_counter())

    def _lookup(self, tracked: Tracked, tokens: list[int], started: float) -> Plan:
        namespace = tracked.namespace
        assert namespace is not None
        try:
            fingerprints = self.manager.fingerprints(tokens, namespace)
            found = self.manager.locate_local([fp.prefix_key for fp in fingerprints])
            rest = fingerprints[self.manager.first_miss(fingerprints, found):]
            found.update(self.manager.locate_remote([fp.prefix_key for fp in rest], namespace))
        except (DirectoryUnavailable, ValueError) as exc:  # the database is down; an unknown namespace
            log.warning("request %s runs without the cache: %s", tracked.request.request_id, exc)
            self.manager.counters.add("lookup_failures")
            return Plan([], 0, [], Decision("no-hit"), time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - a lookup that fails is a miss, never an engine error
            log.exception("request %s: lookup failed, recomputing", tracked.request.request_id)
            self.manager.counters.add("lookup_failures")
            return Plan([], 0, [], Decision("no-hit"), time.perf_counter() - started)
        return self._plan(tracked, fingerprints, found, started)

    def _plan(self, tracked: Tracked, fingerprints: list[BlockFingerprint], found: dict[uuid.UUID, str],
              started: float) -> Plan:
        held = self.manager.prefix_hits(fingerprints, found)
        hits, decision = self.manager.decide(list(held), prompt_tokens=tracked.request.num_tokens,
                                             request=tracked.request.request_id)
        return Plan(fingerprints, len(held), hits, decision, time.perf_counter() - started)

    def _record_plan(self, tracked: Tracked) -> None:
        plan = tracked.plan
        assert plan is not None
        tracked.fingerprints = plan.fingerprints
        tracked.stored = plan.held
        tracked.trace.decision = plan.decision.choice
        tracked.trace.lookup_s = plan.lookup_s
        self.manager.counters.add("lookup_tokens", tracked.request.num_tokens)

    def allocated(self, request: Request, external: int) -> None:
        tracked = self.requests.get(request.request_id)
        if tracked is not None:
            tracked.load_tokens = external

    def hit_sources(self, request: Request, external: int) -> dict[CacheHitSource, int]:
        tracked = self.requests.get(request.request_id)
        if tracked is None or tracked.plan is None or external <= 0:
            return {}
        sources: collections.Counter[CacheHitSource] = collections.Counter()
        end = min(len(tracked.plan.hits) * self.block_tokens, tracked.request.num_tokens - 1)
        start = end - external
        for hit in tracked.plan.hits:
            lo, hi = max(start, hit.index * self.block_tokens), min(end, (hit.index + 1) * self.block_tokens)
            if hi > lo:
                sources[HIT_SOURCES.get(hit.tier, CacheHitSource.EXTERNAL_UNSPECIFIED)] += hi - lo
        return dict(sources)

    # -- each step -------------------------------------------------------------------------------
    def build(self, output: SchedulerOutput) -> StrataMetadata:
        meta = StrataMetadata(scheduled_tokens=output.total_num_scheduled_tokens)
        for new in output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                tracked.pages = list(new.block_ids[0])
                self._step(tracked, new.num_computed_tokens, output.num_scheduled_tokens[new.req_id], meta)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.pages = list(added[0]) if added is not None else []
            elif added is not None:
                tracked.pages.extend(added[0])
            self._step(tracked, cached.num_computed_tokens[i], output.num_scheduled_tokens[req_id], meta)
        return meta

    def _step(self, tracked: Tracked, computed: int, scheduled: int, meta: StrataMetadata) -> None:
        request, size = tracked.request, self.block_tokens
        if not tracked.scheduled:
            tracked.scheduled = True
            tracked.first_step_at = time.time()
            tracked.trace.cached_tokens = computed  # vLLM's own prefix cache and what Strata loads
        if tracked.load_tokens > 0 and tracked.plan is not None and tracked.namespace is not None:
            start, end = computed - tracked.load_tokens, computed
            first, last = start // size, -(-end // size)
            hits = tracked.plan.hits[first:last]
            tracked.load = LoadSpec(request_id=request.request_id, namespace=tracked.namespace,
                                    keys=[h.key for h in hits], tiers=[h.tier for h in hits], first_block=first,
                                    start=start, end=end, pages=list(tracked.pages))
            meta.loads.append(tracked.load)
            tracked.trace.prefix_tokens = end - start
            tracked.trace.hit_blocks_by_tier = dict(collections.Counter(h.tier for h in hits))
            self.manager.touch(tracked.namespace, [h.key for h in hits])
            tracked.load_tokens = 0
        done = min(computed + scheduled, request.num_tokens)
        full = done // size
        if tracked.namespace is not None and full > tracked.stored:
            fingerprints = self._fingerprints(tracked, full)
            if fingerprints is not None:
                meta.saves.append(SaveSpec(
                    request_id=request.request_id, namespace=tracked.namespace, pages=list(tracked.pages),
                    blocks=[(fp.index, fp.prefix_key, fp.content_key) for fp in fingerprints[tracked.stored:full]]))
                tracked.stored = full
        if not tracked.prefilled and done >= request.num_prompt_tokens:
            tracked.prefilled = True
            meta.prefills_done.append(request.request_id)

    def _fingerprints(self, tracked: Tracked, blocks: int) -> list[BlockFingerprint] | None:
        """The request's first `blocks` block keys (its output tokens too, as they grow)."""
        have = tracked.fingerprints
        if len(have) < blocks:
            assert tracked.namespace is not None
            try:
                fingerprinter = self.manager.fingerprinter(tracked.namespace)
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
        now = time.time()
        manager = self.manager
        for name, count in meta.counts.items():
            manager.counters.add(name, count)
        for name, count in meta.store_events.items():
            self.worker_store_events.add(name, count)
        if meta.prefill is not None:
            manager.observe_prefill(*meta.prefill)
        for request_id, report in meta.loads.items():
            manager.observe_load(TierLoad(tier, nbytes, seconds) for tier, nbytes, seconds in report.tier_loads)
            tracked = self.requests.get(request_id)
            trace = tracked.trace if tracked is not None else self._finished_trace(request_id)
            if trace is None:
                continue
            trace.layer_stall_s, trace.layer_loaded_at_s, trace.load_s = report.stalls, report.loaded_at, report.load_s
            if report.failure:
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
        trace = tracked.trace
        trace.output_tokens = request.num_output_tokens
        reason = request.get_finished_reason()
        trace.finish_reason = str(reason) if reason is not None else "abort"
        if trace.ttft_s:
            trace.decode_s = max(0.0, time.time() - trace.started_at - trace.ttft_s)
        self.traces.append(trace)


class _Followed:
    """Gauges of the scheduler half's own state: what it follows now (nothing once vLLM is idle)."""

    def __init__(self, half: SchedulerHalf) -> None:
        self.half = half

    def collect(self) -> Iterator[GaugeMetricFamily]:
        node = self.half.runtime.config.node_name
        tracked = list(self.half.requests.values())
        followed = GaugeMetricFamily("strata_connector_requests", "Requests the vLLM connector follows (from their "
                                     "first lookup to their end).", labels=["node"])
        followed.add_metric([node], len(tracked))
        pending = GaugeMetricFamily("strata_connector_lookups_in_flight", "Lookups of the vLLM connector waiting on "
                                    "the directory or the remote tier.", labels=["node"])
        pending.add_metric([node], sum(1 for t in tracked if t.pending is not None))
        yield from (followed, pending)


def _continue(fingerprinter: Fingerprinter, have: Sequence[BlockFingerprint], tokens: Sequence[int],
              blocks: int) -> list[BlockFingerprint]:
    """The keys of blocks len(have) .. blocks - 1 of `tokens`, chained onto `have`."""
    size = fingerprinter.block_tokens
    start = len(have) * size
    more = fingerprinter.blocks(tokens[start:blocks * size], parent=have[-1].prefix_key if have else None)
    return [dataclasses.replace(fp, index=fp.index + len(have), start=fp.start + start) for fp in more]


# -- the worker's half -----------------------------------------------------------------------------
@dataclasses.dataclass
class PendingSave:
    """A block being gathered layer by layer as the forward pass writes it (layer-wise saves)."""

    spec: SaveSpec
    index: int
    key: uuid.UUID
    content_key: uuid.UUID
    buffer: torch.Tensor
    layers: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class ActiveLoad:
    spec: LoadSpec
    loader: LayerLoader
    buffers: PrefixBuffers
    stalls: list[float]
    failure: LoadFailed | None = None
    scattered: int = 0


class WorkerHalf:
    """Moves the bytes: loads into vLLM's pages layer by layer, saves full blocks from them.

    Saves take one of two paths. On the CPU each new block is gathered from the pages straight
    into its slot of the host pool once the forward pass is done (one copy, then hashed). On a GPU
    (`layerwise_saves`) each layer is copied as soon as its attention has written it, on a stream
    of its own that waits for that layer only (an event per layer), into pinned host memory, so
    the copies overlap the layers still computing; once the step is done the blocks are
    verified into the write-back tier."""

    def __init__(self, runtime: Runtime, *, layerwise_saves: bool | None = None) -> None:
        self.runtime = runtime
        self.layerwise_saves = layerwise_saves
        """None: decided when the KV caches register (layer-wise where they live on a GPU)."""
        self.pending: list[PendingSave] | None = None
        self._stream: Any = None
        self._free_buffers: list[torch.Tensor] = []
        self.manager = runtime.manager
        self.layout = runtime.profile.layout
        self.paged: PagedKV | None = None
        self.layer_of: dict[str, int] = {}
        self.meta: StrataMetadata | None = None
        self.loads: list[ActiveLoad] = []
        self.invalid: set[int] = set()
        self.report = StrataWorkerMeta()
        self.step_started = 0.0
        self._shipped_counts: dict[str, int] = {}
        self._shipped_events: dict[str, int] = {}

    def register(self, kv_caches: Mapping[str, torch.Tensor], backends: Mapping[str, str],
                 layer_index: Callable[[str], int]) -> None:
        names = sorted(kv_caches, key=layer_index)
        kinds = {layout_of(backends[name]) for name in names}
        if len(kinds) != 1:
            raise ValueError(f"StrataConnector: the layers use different attention backends ({sorted(set(backends.values()))})")
        self.paged = PagedKV([kv_caches[name] for name in names], kind=kinds.pop(), layout=self.layout)
        self.layer_of = {name: i for i, name in enumerate(names)}
        if self.layerwise_saves is None:
            self.layerwise_saves = self.paged.device.type == "cuda"
        if self.paged.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.paged.device)
        log.info("StrataConnector: %d layers of %d-token pages (%s layout, %s) as %s blocks",
                 len(names), self.paged.page_tokens, self.paged.kind, self.paged.device, self.layout.describe())

    def bind(self, meta: StrataMetadata) -> None:
        self.meta = meta
        self.pending = None
        self.step_started = time.perf_counter()

    def start_loads(self) -> None:
        meta, paged = self.meta, self.paged
        if meta is None or paged is None:
            return
        for spec in meta.loads:
            try:
                hits = [Hit(index=spec.first_block + i, key=key, tier=tier)
                        for i, (key, tier) in enumerate(zip(spec.keys, spec.tiers, strict=True))]
                with torch.inference_mode(False):
                    buffers = PrefixBuffers(layout=self.layout, blocks=len(hits), device=paged.device)
                loader = LayerLoader(store=self.manager.store, hits=hits, buffers=buffers).start()
            except Exception as exc:  # noqa: BLE001 - a load that cannot start is recomputed
                log.exception("request %s: load could not start, recomputing", spec.request_id)
                self._invalidate(spec)
                self.report.loads[spec.request_id] = LoadReport([], [], 0.0, [], {}, failure=str(exc))
                continue
            self.loads.append(ActiveLoad(spec, loader, buffers, [0.0] * self.layout.layers))

    def wait_layer(self, layer_name: str) -> None:
        if not self.loads or self.paged is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        for load in self.loads:
            if load.failure is not None:
                continue
            spec = load.spec
            try:
                load.stalls[layer] = load.loader.gates[layer].wait()
                self.paged.scatter(layer, load.buffers.typed[layer], first_block=spec.first_block, start=spec.start,
                                   end=spec.end, pages=spec.pages)
                load.scattered += 1
            except LoadFailed as failure:
                self._fail(load, failure)
            except Exception as exc:  # noqa: BLE001 - never an engine error: the pages are recomputed
                log.exception("request %s: load failed at layer %d", spec.request_id, layer)
                self._fail(load, LoadFailed(layer, 0, exc))

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
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for save in self.pending:
                k_dst, v_dst = self.layout.kv_views(save.buffer)[layer]
                paged.gather_layer(layer, k_dst, v_dst, index=save.index, pages=save.spec.pages,
                                   non_blocking=stream is not None)
                save.layers.add(layer)

    def _pending(self, saves: Sequence[SaveSpec]) -> list[PendingSave]:
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
        if self._free_buffers:
            return self._free_buffers.pop()
        with torch.inference_mode(False):
            return self.layout.empty(pin=self._stream is not None)

    def _fail(self, load: ActiveLoad, failure: LoadFailed) -> None:
        load.failure = failure
        load.loader.cancel()
        spec = load.spec
        self._invalidate(spec)
        self.manager.counters.add("load_failures")
        if failure.block_index < len(spec.keys):
            self.manager.quarantine(spec.keys[failure.block_index], failure.cause, spec.namespace)
        log.warning("request %s: load failed (%s); vLLM recomputes its %d tokens", spec.request_id, failure,
                    spec.end - spec.start)

    def _invalidate(self, spec: LoadSpec) -> None:
        """Every page the load was to fill: vLLM recomputes from the first of them."""
        assert self.paged is not None
        n = self.paged.page_tokens
        self.invalid.update(spec.pages[spec.start // n:-(-spec.end // n)])

    def finish_step(self) -> None:
        """After the forward pass: settle the loads, then save the step's new full blocks."""
        meta = self.meta
        if meta is None:
            return
        for load in self.loads:
            self._settle(load)
        self.loads = []
        if self.layerwise_saves:
            self._commit_layerwise()
        elif meta.saves and self.paged is not None:
            self._save(meta.saves)
        forward_s = time.perf_counter() - self.step_started
        if not meta.loads and meta.scheduled_tokens >= self.layout.block_tokens:
            self.report.prefill = (meta.scheduled_tokens, forward_s)
        self.report.prefills_done.extend(meta.prefills_done)

    def _settle(self, load: ActiveLoad) -> None:
        loader, spec = load.loader, load.spec
        loader.join()
        if load.failure is None and load.scattered < self.layout.layers:
            # A layer the model never asked for (a step without attention metadata): not loaded.
            self._fail(load, LoadFailed(load.scattered, 0, RuntimeError("layers were not loaded in this step")))
        blocks = dict(collections.Counter(spec.tiers))
        report = LoadReport(
            stalls=load.stalls, loaded_at=[t.finished - loader.started_at for t in loader.timings],
            load_s=max(0.0, loader.finished_at - loader.started_at),
            tier_loads=[(t.tier, t.bytes, t.seconds) for t in loader.tier_loads()], blocks_by_tier=blocks,
            failure="" if load.failure is None else str(load.failure))
        self.report.loads[spec.request_id] = report
        if load.failure is None:
            tokens = spec.end - spec.start
            self.manager.counters.add("hit_tokens", tokens)
            self.manager.counters.add("reused_tokens.prefix", tokens)
            for tier, count in blocks.items():
                self.manager.counters.add(f"hit_blocks.{tier}", count)

    def _save(self, saves: Sequence[SaveSpec]) -> None:
        manager, paged = self.manager, self.paged
        assert paged is not None
        registrations = []
        for spec in saves:
            keys = [key for _, key, _ in spec.blocks]
            try:
                held = manager.holds(keys)
            except Exception as exc:  # noqa: BLE001 - a tier that cannot answer takes no write either
                log.warning("request %s: blocks not saved: %s", spec.request_id, exc)
                continue
            written = 0
            for (index, key, content_key), have in zip(spec.blocks, held, strict=True):
                if have:
                    continue
                registration = manager.store_block(
                    key=key, content_key=content_key, position=index * self.layout.block_tokens,
                    namespace=spec.namespace, fill=self._filler(key, index, spec.pages))
                if registration is not None:
                    registrations.append(registration)
                    written += 1
            if written:
                self.report.saved[spec.request_id] = self.report.saved.get(spec.request_id, 0) + written
        manager.register(registrations)

    def _commit_layerwise(self) -> None:
        """Store the blocks gathered layer by layer in this step (once their copies are done)."""
        pending, self.pending = self.pending or [], None
        if not pending:
            return
        if self._stream is not None:
            self._stream.synchronize()
        registrations = []
        for save in pending:
            if len(save.layers) == self.layout.layers:
                registration = self.manager.store_block(
                    key=save.key, content_key=save.content_key, position=save.index * self.layout.block_tokens,
                    namespace=save.spec.namespace, data=save.buffer)
                if registration is not None:
                    registrations.append(registration)
                    self.report.saved[save.spec.request_id] = self.report.saved.get(save.spec.request_id, 0) + 1
            else:  # a layer the model never handed over (a step without attention metadata)
                self.manager.counters.add("write_back.incomplete")
            self._free_buffers.append(save.buffer)
        self.manager.register(registrations)

    def _filler(self, key: uuid.UUID, index: int, pages: list[int]) -> Callable[[torch.Tensor], BlockChecksum]:
        paged, layout = self.paged, self.layout
        assert paged is not None
        engine = self.manager.target.engine

        def fill(block: torch.Tensor) -> BlockChecksum:
            paged.gather(block, index=index, pages=pages)
            checksum = engine.checksum(key, block, layout)
            assert isinstance(checksum, BlockChecksum)  # a whole block
            return checksum

        return fill

    def take_invalid(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def take_report(self) -> StrataWorkerMeta | None:
        report, self.report = self.report, StrataWorkerMeta()
        report.counts = _delta(self.manager.counters.snapshot(), self._shipped_counts)
        report.store_events = _delta(self.manager.store.stats(), self._shipped_events)
        if not (report.loads or report.saved or report.prefills_done or report.prefill or report.counts
                or report.store_events):
            return None
        return report


def _delta(now: dict[str, int], shipped: dict[str, int]) -> dict[str, int]:
    """What grew since `shipped` (which becomes `now`)."""
    grown = {name: value - shipped.get(name, 0) for name, value in now.items() if value != shipped.get(name, 0)}
    shipped.clear()
    shipped.update(now)
    return grown


# -- the connector vLLM loads ------------------------------------------------------------------------
class StrataConnectorBase(KVConnectorBase_V1):
    """The KV connector. Subclasses give it the fleet's directory (`open_directory`); without one,
    it serves from the node's tiers alone (the remote tier asked directly)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config)
        config = node_options(self._kv_transfer_config.kv_connector_extra_config or {})
        profile = profile_for(vllm_config, config.block_tokens)
        self.runtime = self._open(config, profile, role)
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(self.runtime, page_tokens=vllm_config.cache_config.block_size)
            self.scheduler.serve_status()
        else:
            self.worker = WorkerHalf(self.runtime)
        log.info("StrataConnector (%s) for %s on node %s: tiers %s, write-back to %s, directory %s",
                 role.name.lower(), profile.model_id, config.node_name, ",".join(self.runtime.store.names),
                 self.runtime.manager.write_back_tier, "on" if self.runtime.directory is not None else "off")

    def _open(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Runtime:
        tiers = [name for name in config.tiers if name != "device"]  # vLLM's pages are L1
        if not tiers:
            raise ValueError("StrataConnector: tiers lists no tier below L1 (host, disk or remote)")
        config = dataclasses.replace(config, tiers=type(config.tiers)(tiers))
        directory = self.open_directory(config, profile, role)
        try:
            store = build_store(config, profile=profile, environ=self.store_environ())
        except BaseException:
            if directory is not None:
                directory.close()
            raise
        write_back = "host" if "host" in store.names else store.names[0]
        manager = OffloadManager(store=store, profile=profile, node=config.node_name, directory=directory,
                                 write_back_tier=write_back)
        return Runtime(config=config, profile=profile, store=store, directory=directory, manager=manager)

    # -- hooks for the control plane's subclass ---------------------------------------------------
    def open_directory(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Directory | None:
        """The fleet's block directory (None: the node's tiers alone)."""
        return None

    def store_environ(self) -> Mapping[str, str] | None:
        """Environment the tiers are built from (None: this process's)."""
        return None

    # -- scheduler -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self.scheduler.matched_tokens(request, num_computed_tokens), False
        except Exception:  # noqa: BLE001 - a failing lookup is a miss, never an engine error
            log.exception("request %s: lookup failed, recomputing", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self.scheduler is not None
        try:
            return self.scheduler.hit_sources(request, num_external_tokens)
        except Exception:  # noqa: BLE001 - statistics only
            log.exception("request %s: hit sources unknown", request.request_id)
            return {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        try:
            return self.scheduler.build(scheduler_output)
        except Exception:  # noqa: BLE001 - a step without Strata work: requests promised a load are
            # then not loaded, and vLLM recomputes them (no load means no pages filled: see
            # WorkerHalf._settle, which fails a load whose layers never arrived).
            log.exception("building this step's connector work failed")
            return StrataMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.update(connector_output)
        except Exception:  # noqa: BLE001 - bookkeeping only
            log.exception("the worker's report could not be read")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        try:
            self.scheduler.finished(request)
        except Exception:  # noqa: BLE001 - bookkeeping only
            log.exception("request %s: end not recorded", request.request_id)
        return False, None

    # -- worker --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        assert self.worker is not None
        context = self._vllm_config.compilation_config.static_forward_context
        backends = {name: context[name].attn_backend.get_name() for name in kv_caches}
        self.worker.register(kv_caches, backends, extract_layer_index)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StrataMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Layer-wise saves copy the layer now (on a GPU); otherwise the step's full blocks are
        gathered once the forward pass is done (wait_for_save), straight into the write-back tier."""
        assert self.worker is not None
        try:
            self.worker.save_layer(layer_name)
        except Exception:  # noqa: BLE001 - a save that fails is a future miss, never an engine error
            log.exception("layer %s of this step's blocks was not saved", layer_name)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        try:
            self.worker.finish_step()
        except Exception:  # noqa: BLE001 - a save that fails is a future miss, never an engine error
            log.exception("this step's blocks were not saved")
        finally:
            self.worker.meta = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_invalid()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        try:
            return self.worker.take_report()
        except Exception:  # noqa: BLE001 - statistics only
            log.exception("the step's report could not be built")
            return None

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.runtime.close()

