"""The connector's numbers on vLLM's own /metrics, beside `vllm:*`: what it counted (blocks and
tokens hit by tier, tokens loaded, loads failed or past their deadline, lookups past theirs,
corrupt blocks, saves stored, dropped or made inside the step, evictions) and how long each load
took and stalled the forward pass, as vLLM's connector stats.

    engine core: scheduler half                               API server
    counters (its own + the worker's, folded in `update`)
    StatsTap.take() after each step: what grew since   ->   StrataConnectorStats   ->   StrataPromMetrics
    the last one, each load's time and stall                (vLLM logs its reduce)       vllm:strata_*

vLLM asks the scheduler's connector for its stats after every step (`get_kv_connector_stats`),
carries them to the API server with the step's outputs and hands them to the class methods
`build_kv_connector_stats` and `build_prom_metrics` there. The counters are the ones the
connector's status endpoint exports (`metrics.EngineMetrics`), so both show the same numbers;
the worker's reach the scheduler with its step report, so a worker's count shows after the next
step. The status endpoint's gauges of what the scheduler half follows live here too
(`FollowedGauges`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclasses.dataclass(frozen=True)
class Family:
    """One counter on vLLM's /metrics: the connector counters whose names match `pattern` (its
    named groups are the labels) are summed into it."""

    name: str
    documentation: str
    pattern: re.Pattern[str]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.pattern.groupindex)


def _family(name: str, documentation: str, pattern: str) -> Family:
    return Family(f"vllm:strata_{name}", documentation, re.compile(pattern))


FAMILIES = (
    _family("lookup_tokens", "Prompt tokens Strata looked up.", r"lookup_tokens"),
    _family("hit_blocks", "Blocks loaded from Strata, by the tier that held them.", r"hit_blocks\.(?P<tier>\w+)"),
    _family(
        "hit_tier_tokens",
        "Prompt tokens of the blocks loaded from Strata, by the tier that held them (whole blocks).",
        r"hit_tier_tokens\.(?P<tier>\w+)",
    ),
    _family("hit_tokens", "Tokens Strata loaded into vLLM's pages.", r"hit_tokens"),
    _family(
        "load_failures",
        "Loads that failed (a block corrupt or missing, a tier past its deadline) and that vLLM recomputed.",
        r"load_failures",
    ),
    _family("load_deadlines", "Loads given up at load_deadline_seconds (recomputed).", r"load_deadlines"),
    _family(
        "lookup_deadlines",
        "Requests served without the cache: no lookup answer within lookup_deadline_seconds.",
        r"lookup_deadlines",
    ),
    _family(
        "lookup_failures",
        "Lookups served as misses: the directory could not be asked or the namespace was not valid.",
        r"lookup_failures",
    ),
    _family(
        "corrupt_blocks",
        "Copies that failed their checksum on a read, by tier: a miss, never served, quarantined.",
        r"(?P<tier>host|disk|remote)\.corrupt",
    ),
    _family(
        "saved_blocks", "Blocks stored in a Strata tier at write-back, by tier.", r"write_back\.(?P<tier>\w+)\.stored"
    ),
    _family("write_through_blocks", "Blocks also copied to the remote tier at write-back.", r"write_through\.blocks"),
    _family(
        "dropped_saves",
        "Blocks not saved, by reason: the write-back tier refused, was full or failed; a layer or a "
        "rank's share was missing (incomplete); the step's saves could not be planned (unplanned); "
        "the block was computed over pages a failed load left (poisoned).",
        r"write_back\.(?:\w+\.)?(?P<reason>refused|full|failed|incomplete|unplanned|poisoned)",
    ),
    _family(
        "inline_saves",
        "Blocks stored inside the engine step: the save queue's budget (save_staging_bytes) was spent.",
        r"write_back\.inline",
    ),
    _family(
        "evictions",
        "Blocks evicted from the node's tiers at write-back, by tier and reason (pressure, quota, ttl).",
        r"eviction\.(?P<tier>\w+)\.(?P<reason>\w+)",
    ),
    _family(
        "reused_tokens",
        "Prompt positions whose KV came from Strata, by kind (prefix: exact leading blocks; fragment: blocks "
        "matched elsewhere in the prompt, recomputed positions included).",
        r"reused_tokens\.(?P<kind>prefix|fragment)",
    ),
    _family("blend_requests", "Requests whose load was blended from fragments.", r"blend\.requests"),
    _family(
        "blend_recomputed_tokens", "Fragment tokens recomputed by selective recompute.", r"blend\.recomputed_tokens"
    ),
    _family("blend_failures", "Blended loads that failed and that vLLM recomputed whole.", r"blend\.failures"),
    _family(
        "blend_quality_samples",
        "Blended requests compared with a full prefill, by result (dropped: the checker was busy).",
        r"blend\.samples_(?P<result>agreed|disagreed|dropped)",
    ),
    _family(
        "blend_adjustments",
        "The quality guard's and operators' changes: r raised, fallen back to prefix reuse, probed again, set "
        "by an operator.",
        r"blend\.(?P<action>ratio_raised|fallbacks|reprobes|operator_changes)",
    ),
    _family(
        "uncached_requests",
        "Requests served without the cache, by reason (what Strata cannot key, or a namespace claim refused).",
        r"uncached\.(?P<reason>[\w.]+)",
    ),
)
"""What goes to vLLM's /metrics, each a `<name>_total` counter labelled model_name and engine."""

LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def exported(name: str) -> tuple[Family, tuple[str, ...]] | None:
    """The family a connector counter is exported in and its label values (None: not exported)."""
    for family in FAMILIES:
        found = family.pattern.fullmatch(name)
        if found is not None:
            return family, tuple(found.group(label) for label in family.labels)
    return None


@dataclasses.dataclass
class StrataConnectorStats(KVConnectorStats):
    """What the connector counted in an interval, as vLLM carries it from the engine to the API
    server (plain data): `counts` (connector counter name -> growth), `load_seconds` and
    `stall_seconds` (one per load that succeeded; stalls of the loads inside the step)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self.data.setdefault("counts", {})
        self.data.setdefault("load_seconds", [])
        self.data.setdefault("stall_seconds", [])

    @classmethod
    def build(cls, data: Mapping[str, Any] | None) -> StrataConnectorStats:
        """Stats over a copy of `data` (vLLM may aggregate into what it builds)."""
        return cls(data=copy.deepcopy(dict(data or {})))

    def reset(self) -> None:
        self.data = {"counts": {}, "load_seconds": [], "stall_seconds": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, StrataConnectorStats):
            counts = self.data["counts"]
            for name, value in other.data["counts"].items():
                counts[name] = counts.get(name, 0) + value
            self.data["load_seconds"].extend(other.data["load_seconds"])
            self.data["stall_seconds"].extend(other.data["stall_seconds"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a line of vLLM's log: each counter that grew, the loads' mean time and stall."""
        summary: dict[str, int | float] = {name: value for name, value in sorted(self.data["counts"].items()) if value}
        loads, stalls = self.data["load_seconds"], self.data["stall_seconds"]
        if loads:
            summary["loads"] = len(loads)
            summary["avg load (ms)"] = round(1e3 * sum(loads) / len(loads), 3)
        if stalls:
            summary["avg stall (ms)"] = round(1e3 * sum(stalls) / len(stalls), 3)
        return summary

    def is_empty(self) -> bool:
        return not (any(self.data["counts"].values()) or self.data["load_seconds"] or self.data["stall_seconds"])


class StrataPromMetrics(KVConnectorPromMetrics):
    """The connector's families on vLLM's /metrics (in the API server's process): a counter per
    `FAMILIES` entry and the loads' time and stall histograms, labelled per engine as vLLM's own."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types the three classes as one union; each is the prometheus_client class it names.
        counter_cls = cast("type[Counter]", self._counter_cls)
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self.counters: dict[str, Counter] = {}
        for family in FAMILIES:
            counter = counter_cls(
                name=family.name, documentation=family.documentation, labelnames=[*labelnames, *family.labels]
            )
            self.counters[family.name] = counter
            if not family.labels:  # shown at 0 from the start, as vLLM's own counters
                create_metric_per_engine(counter, per_engine_labelvalues)
        load = histogram_cls(
            name="vllm:strata_load_seconds",
            documentation="Time to load a request's blocks from Strata's tiers into vLLM's pages, per load.",
            buckets=LOAD_BUCKETS,
            labelnames=labelnames,
        )
        stall = histogram_cls(
            name="vllm:strata_load_stall_seconds",
            documentation="Time the forward pass waited for a load inside the engine step, summed over the "
            "layers, per load.",
            buckets=LOAD_BUCKETS,
            labelnames=labelnames,
        )
        self.load = {engine: load.labels(*values) for engine, values in per_engine_labelvalues.items()}
        self.stall = {engine: stall.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counts", {}).items():
            found = exported(name)
            if found is not None and value > 0:
                family, labels = found
                self.counters[family.name].labels(*engine, *labels).inc(value)
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self.load[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("stall_seconds", ()):
            self.stall[engine_idx].observe(seconds)


class StatsTap:
    """The scheduler half's side: what the connector counted since vLLM last asked (`take`). `read`
    gives every counter (the manager's, those the worker reported, the store's tier events)."""

    def __init__(self, read: Callable[[], Mapping[str, int]], *, block_tokens: int) -> None:
        self._read = read
        self.block_tokens = block_tokens
        self._shipped: dict[str, int] = {}
        self._exported: dict[str, bool] = {}
        self._loads: list[float] = []
        self._stalls: list[float] = []

    def loaded(self, seconds: float, stalls: Sequence[float]) -> None:
        """A load that succeeded: its time, and its stall where it ran inside the step (`stalls`
        per layer; none for a load outside it)."""
        self._loads.append(seconds)
        if stalls:
            self._stalls.append(sum(stalls))

    def counts(self) -> dict[str, int]:
        """Every exported counter now, the hit tokens by tier among them (whole blocks)."""
        counts: dict[str, int] = {}
        for name, value in self._read().items():
            known = self._exported.get(name)
            if known is None:
                known = self._exported[name] = exported(name) is not None
            if known:
                counts[name] = value
            if name.startswith("hit_blocks."):
                counts[f"hit_tier_tokens.{name.removeprefix('hit_blocks.')}"] = value * self.block_tokens
        return counts

    def take(self) -> StrataConnectorStats | None:
        """What grew since the last call (None: nothing)."""
        now = self.counts()
        grown = {name: value - self._shipped.get(name, 0) for name, value in now.items()}
        grown = {name: value for name, value in grown.items() if value > 0}
        self._shipped = now
        loads, self._loads = self._loads, []
        stalls, self._stalls = self._stalls, []
        if not (grown or loads or stalls):
            return None
        return StrataConnectorStats(data={"counts": grown, "load_seconds": loads, "stall_seconds": stalls})


def merged(*sources: Callable[[], Mapping[str, int]]) -> Callable[[], dict[str, int]]:
    """A reader of several counter sets at once, summed by name."""

    def read() -> dict[str, int]:
        total: dict[str, int] = {}
        for source in sources:
            for name, value in source().items():
                total[name] = total.get(name, 0) + value
        return total

    return read


class FollowedGauges:
    """Gauges of the scheduler half's own state for its status endpoint: what it follows now
    (nothing once vLLM is idle). `follow` gives (requests, lookups in flight, policy version)."""

    def __init__(self, node: str, follow: Callable[[], tuple[int, int, int]]) -> None:
        self.node = node
        self.follow = follow

    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests, lookups, version = self.follow()
        followed = GaugeMetricFamily(
            "strata_connector_requests",
            "Requests the vLLM connector follows (from their first lookup to their end).",
            labels=["node"],
        )
        followed.add_metric([self.node], requests)
        pending = GaugeMetricFamily(
            "strata_connector_lookups_in_flight",
            "Lookups of the vLLM connector waiting on the directory or the remote tier.",
            labels=["node"],
        )
        pending.add_metric([self.node], lookups)
        policy = GaugeMetricFamily(
            "strata_connector_policy_version",
            "The policy version the vLLM connector enforces at write-back (0: none read yet).",
            labels=["node"],
        )
        policy.add_metric([self.node], version)
        yield from (followed, pending, policy)
