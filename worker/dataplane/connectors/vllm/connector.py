"""StrataConnectorBase, the KV connector class vLLM loads: each of vLLM's hooks, guarded so that an
error inside Strata is a miss and a log line, never an exception in vLLM's engine loop, handed
to the half of the role it runs in (`scheduler_half`, `worker_half`). What it counted goes to
vLLM's own /metrics (`stats`), the blocks it stores and drops to vLLM's KV events (`kv_events`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.tuner import BlendTuner
from worker.dataplane.config import NodeConfig
from worker.dataplane.connectors.pages import layout_of
from worker.dataplane.connectors.status import Blending
from worker.dataplane.connectors.vllm.blend_model import blend_start_problem
from worker.dataplane.connectors.vllm.fragments import FragmentFinder
from worker.dataplane.connectors.vllm.kv_events import BlockEvents, TierChanges
from worker.dataplane.connectors.vllm.metadata import StrataMetadata
from worker.dataplane.connectors.vllm.runtime import (
    PolicyFollower,
    PolicyRead,
    Runtime,
    check_engine,
    check_kv_cache,
    node_options,
    profile_for,
)
from worker.dataplane.connectors.vllm.scheduler_half import SchedulerHalf
from worker.dataplane.connectors.vllm.sharding import model_shard
from worker.dataplane.connectors.vllm.stats import StrataConnectorStats, StrataPromMetrics
from worker.dataplane.connectors.vllm.worker_half import WorkerHalf
from worker.dataplane.directory import Directory
from worker.dataplane.layout import ModelProfile
from worker.dataplane.offload import OffloadManager
from worker.dataplane.store import build_store
from worker.dataplane.tier_names import DEVICE, HOST

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("strata.vllm")


class StrataConnectorBase(KVConnectorBase_V1):
    """The KV connector. Subclasses give it the fleet's directory (`open_directory`); without one,
    it serves from the node's tiers alone (the remote tier asked directly)."""

    _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: loads wait layer by layer (`wait_for_layer_load`) and a GPU's saves copy each
        layer as its attention writes it (`save_kv_layer`). A full CUDA graph replays a step
        without these hooks (a decode-shaped step: decodes, or a hit with one token left to
        compute), so vLLM runs piecewise graphs, between whose pieces the hooks run."""
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config)
        check_kv_cache(kv_cache_config, vllm_config.model_config.model)
        config = node_options(self._kv_transfer_config.kv_connector_extra_config or {})
        profile = profile_for(vllm_config, config)
        self.runtime = self._open(config, profile, role)
        read = self.policies_source()
        self.policies = (
            PolicyFollower(self.runtime, read, interval_s=config.heartbeat_seconds).start() if read else None
        )
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        events = vllm_config.kv_events_config
        publishes = events is not None and events.enable_kv_cache_events  # vLLM publishes KV events
        if role == KVConnectorRole.SCHEDULER:
            page_tokens = vllm_config.cache_config.block_size
            self.scheduler = SchedulerHalf(
                self.runtime,
                page_tokens=page_tokens,
                events=BlockEvents(block_tokens=profile.block_tokens, page_tokens=page_tokens) if publishes else None,
            )
            # data_parallel_index: the rank, also where vLLM runs a dense model's ranks as independent
            # engines (there data_parallel_rank is 0 on every one).
            parallel = vllm_config.parallel_config
            self.scheduler.serve_status(
                data_parallel_rank=getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
            )
        else:
            shard, gather = model_shard(profile.kv_heads, profile.layers)
            self.worker = WorkerHalf(
                self.runtime, shard=shard, gather=gather, changes=TierChanges() if publishes else None
            )
        if config.blend and role == KVConnectorRole.SCHEDULER:
            self._start_blending(vllm_config, config, profile)
        if self.scheduler is not None and self.scheduler.server is not None and self.scheduler.server.blending is None:
            # Off (or refused): /v1/strata/blend reports it so, and refuses changes.
            self.scheduler.server.blending = Blending(model=profile.model_id, options=BlendOptions.from_config(config))
        log.info(
            "StrataConnector (%s) for %s on node %s: tiers %s, write-back to %s, directory %s",
            role.name.lower(),
            profile.model_id,
            config.node_name,
            ",".join(self.runtime.store.names),
            self.runtime.manager.write_back_tier,
            "on" if self.runtime.directory is not None else "off",
        )

    def _start_blending(self, vllm_config: VllmConfig, config: NodeConfig, profile: ModelProfile) -> None:
        """Fragment reuse, where this vLLM server's model and layout can be blended; else one line
        saying why not, and the node reuses prefixes only."""
        import vllm  # noqa: PLC0415 - the version this server runs

        parallel = vllm_config.parallel_config
        architecture = (vllm_config.model_config.architectures or ["(none)"])[0]
        problem = blend_start_problem(
            architecture,
            vllm_version=vllm.__version__,
            tensor_parallel=parallel.tensor_parallel_size,
            pipeline_parallel=parallel.pipeline_parallel_size,
        )
        if problem is not None:
            log.warning(
                "StrataConnector on node %s: fragment reuse refused (%s); this node reuses prefixes only",
                config.node_name,
                problem,
            )
            return
        options = BlendOptions.from_config(config)
        assert self.scheduler is not None  # the scheduler's role built it
        manager = self.runtime.manager
        tuner = BlendTuner(options=options, full_prefill=None, counters=manager.counters, model=profile.model_id)
        self.scheduler.fragments = FragmentFinder(
            manager, options, tuner, model=profile.model_id, deadline_s=config.lookup_deadline_seconds
        )
        self.scheduler.metrics.tuner = tuner
        if self.scheduler.server is not None:
            self.scheduler.server.blending = Blending(model=profile.model_id, options=options, tuner=tuner)
        log.info(
            "StrataConnector on node %s: fragment reuse on (r %g%%, %s selection, check layer %d; %g%% of blended "
            "requests checked against a full prefill)",
            config.node_name,
            options.model_default(profile.model_id),
            options.selection,
            options.check_layer,
            100 * options.sample_rate,
        )

    def _open(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Runtime:
        tiers = [name for name in config.tiers if name != DEVICE]  # vLLM's pages are L1
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
        write_back = HOST if HOST in store.names else store.names[0]
        manager = OffloadManager(
            store=store, profile=profile, node=config.node_name, directory=directory, write_back_tier=write_back
        )
        return Runtime(config=config, profile=profile, store=store, directory=directory, manager=manager)

    # -- hooks for the control plane's subclass ---------------------------------------------------
    def open_directory(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Directory | None:
        """The fleet's block directory (None: the node's tiers alone)."""
        return None

    def store_environ(self) -> Mapping[str, str] | None:
        """Environment the tiers are built from (None: this process's)."""
        return None

    def policies_source(self) -> PolicyRead | None:
        """Where the policies in force are read (None: the defaults, none followed)."""
        return None

    # -- vLLM's metrics and KV events --------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return StrataConnectorStats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return StrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler's (the worker's counters reach it with each step's report); None in a worker."""
        if self.scheduler is None:
            return None
        try:
            return self.scheduler.stats.take()
        except Exception:  # noqa: BLE001 - statistics only
            log.exception("the connector's stats could not be read")
            return None

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.scheduler is None or self.scheduler.events is None:
            return ()
        return self.scheduler.events.take()

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is None:
            return
        self.scheduler.bind_prefix_cache(kv_cache_manager)
        if self.scheduler.events is not None:
            # The block size vLLM hashes requests by (its pages' unless a model mixes page sizes).
            self.scheduler.events.hash_block_tokens = kv_cache_manager.block_pool.hash_block_size

    # -- scheduler -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            matched = self.scheduler.matched_tokens(request, num_computed_tokens)
            return matched, bool(matched) and self.scheduler.asynchronous(request)
        except Exception:  # noqa: BLE001 - a failing lookup is a miss, never an engine error
            log.exception("request %s: lookup failed, recomputing", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        pages = blocks.get_block_ids()[0] if num_external_tokens else ()
        self.scheduler.allocated(request, num_external_tokens, pages)

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
        except Exception as exc:  # noqa: BLE001 - never an engine error; every promised load is refused
            # (handed over as failed: vLLM recomputes its pages), never dropped: a load vLLM was
            # promised and the worker never heard of would leave its pages unfilled and served.
            log.exception("building this step's connector work failed")
            try:
                return self.scheduler.refused(scheduler_output, f"the step could not be planned: {exc}")
            except Exception:  # noqa: BLE001
                log.exception("refusing this step's loads failed")
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
        # vLLM's CPU attention picks its kernels' instruction set per model (and marks its layers
        # with it) before the KV caches are registered: each keeps its pages in its own layout.
        layouts = {
            name: layout_of(context[name].attn_backend.get_name(), getattr(context[name], "isa", None))
            for name in kv_caches
        }
        self.worker.register(
            kv_caches, layouts, extract_layer_index, block_size=self._vllm_config.cache_config.block_size
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StrataMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        try:
            self.worker.start_loads()
        except Exception as exc:  # noqa: BLE001 - never an engine error: the step's loads are recomputed
            log.exception("this step's loads could not start; vLLM recomputes them")
            self.worker.abandon_loads(exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        try:
            self.worker.wait_layer(layer_name)
        except Exception as exc:  # noqa: BLE001 - never an engine error (a rank that raised would stall the others)
            log.exception("layer %s of this step's loads failed; vLLM recomputes them", layer_name)
            self.worker.abandon_loads(exc)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Layer-wise saves copy the layer now (on a GPU); otherwise the step's full blocks are
        copied out of the pages once the forward pass is done (wait_for_save)."""
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose asynchronous load ended (loaded, failed or given up: the failures'
        pages are in get_block_ids_with_load_errors, which vLLM reads next)."""
        assert self.worker is not None
        try:
            ended = self.worker.take_finished()
        except Exception:  # noqa: BLE001 - never an engine error
            log.exception("the asynchronous loads' ends could not be read")
            return None, None
        return None, ended or None

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
        if self.worker is not None:
            self.worker.close()  # the blocks its save queue still holds are stored first
        if self.policies is not None:
            self.policies.close()
        if self.scheduler is not None:
            self.scheduler.close()
        self.runtime.close()
