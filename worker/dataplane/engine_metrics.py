"""The Prometheus view of an engine: its offload manager's counters and tiers, per-layer stall, TTFT and load
histograms, and fragment reuse where the engine blends."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.dataplane.blend.tuner import PREFIX_ONLY, BlendTuner
from worker.dataplane.counters import Counters
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import RequestTrace


def installed_version() -> str:
    """The installed strata-kv's version (`unknown` for a tree run without installing it)."""
    try:
        return version("strata-kv")
    except PackageNotFoundError:
        return "unknown"


class EngineMetrics:
    """Prometheus view of one engine's offload manager (its counters and tiers), per-layer stall
    and TTFT histograms, and fragment reuse where the engine has a tuner. Both engines export it:
    the node server and the vLLM connector's status server."""

    def __init__(
        self,
        offload: OffloadManager,
        node: str,
        *,
        model: str,
        tuner: BlendTuner | None = None,
        store_events: Counters | None = None,
    ) -> None:
        self.offload = offload
        self.store_events = store_events
        """Tier events of stores in other processes (a vLLM worker's), exported with this store's."""
        self.model = model
        self.tuner = tuner
        self.node = node
        self.registry = CollectorRegistry()
        self.stall = Histogram(
            "strata_layer_stall_seconds",
            "Time a layer's attention waited for its KV to load, per layer.",
            ["node", "layer"],
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=self.registry,
        )
        self.ttft = Histogram(
            "strata_ttft_seconds",
            "Time to first token of engine requests.",
            ["node", "cache"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.load = Histogram(
            "strata_load_seconds",
            "Time to load a request's cached blocks (all layers).",
            ["node"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.registry.register(self)

    def observe(self, trace: RequestTrace) -> None:
        for layer, stall in enumerate(trace.layer_stall_s):
            self.stall.labels(node=self.node, layer=str(layer)).observe(stall)
        self.ttft.labels(node=self.node, cache="hit" if trace.cached_tokens else "miss").observe(trace.ttft_s)
        if trace.cached_tokens:
            self.load.labels(node=self.node).observe(trace.load_s)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        build = GaugeMetricFamily("strata_build_info", "The running Strata version (always 1).", labels=["version"])
        build.add_metric([installed_version()], 1.0)
        yield build
        counts = self.offload.counters.snapshot()
        lookup = CounterMetricFamily("strata_lookup_tokens", "Prompt tokens looked up in the cache.", labels=["node"])
        lookup.add_metric([self.node], counts.get("lookup_tokens", 0))
        hits = CounterMetricFamily("strata_hit_tokens", "Prompt tokens served from the cache.", labels=["node"])
        hits.add_metric([self.node], counts.get("hit_tokens", 0))
        blocks = CounterMetricFamily(
            "strata_hit_blocks", "Blocks served from the cache, by tier.", labels=["node", "tier"]
        )
        tier_tokens = CounterMetricFamily(
            "strata_hit_tier_tokens",
            "Prompt tokens served from the cache, by the tier that held them (every hit block is a full block).",
            labels=["node", "tier"],
        )
        decisions = CounterMetricFamily(
            "strata_load_decisions", "Load-or-recompute decisions.", labels=["node", "decision"]
        )
        failures = CounterMetricFamily(
            "strata_load_failures", "Loads that failed (block missing or corrupt) and were recomputed.", labels=["node"]
        )
        failures.add_metric([self.node], counts.get("load_failures", 0))
        lookup_failures = CounterMetricFamily(
            "strata_lookup_failures",
            "Lookups served as misses because the directory could not be asked "
            "(database down) or the request named no valid namespace.",
            labels=["node"],
        )
        lookup_failures.add_metric([self.node], counts.get("lookup_failures", 0))
        deadlines = CounterMetricFamily(
            "strata_deadlines",
            "Waits of the serving path given up at their deadline, by wait: lookup (no answer within "
            "lookup_deadline_seconds: served without the cache's hits) and load (a layer not in within "
            "load_deadline_seconds: recomputed).",
            labels=["node", "wait"],
        )
        for wait in ("lookup", "load"):
            deadlines.add_metric([self.node, wait], counts.get(f"{wait}_deadlines", 0))
        uncached = CounterMetricFamily(
            "strata_uncached_requests",
            "Requests served without the cache because Strata cannot key what they carry (prompt_embeds, "
            "multimodal, an unreadable LoRA adapter, a field it does not know) or their namespace claim was invalid.",
            labels=["node", "reason"],
        )
        for name, value in counts.items():
            if name.startswith("uncached."):
                uncached.add_metric([self.node, name.removeprefix("uncached.")], value)
        for name, value in counts.items():
            if name.startswith("hit_blocks."):
                blocks.add_metric([self.node, name.removeprefix("hit_blocks.")], value)
                tier_tokens.add_metric(
                    [self.node, name.removeprefix("hit_blocks.")], value * self.offload.layout.block_tokens
                )
            elif name.startswith("decision."):
                decisions.add_metric([self.node, name.removeprefix("decision.")], value)
        store = CounterMetricFamily(
            "strata_store_events",
            "Tier events of the node's store (corrupt, quarantined, unavailable, ...).",
            labels=["node", "event"],
        )
        events = collections.Counter(self.offload.store.stats())
        if self.store_events is not None:
            events.update(self.store_events.snapshot())
        for name, value in sorted(events.items()):
            store.add_metric([self.node, name], value)
        unverified = CounterMetricFamily(
            "strata_remote_unverified",
            "Loads that failed on a copy in the shared remote tier whose checksum is not the one the "
            "directory registered for the block (bytes written under its key by someone who did not "
            "register them): recomputed, the copy dropped and quarantined.",
            labels=["node"],
        )
        unverified.add_metric([self.node], counts.get("remote_unverified", 0))
        used = GaugeMetricFamily(
            "strata_tier_used_bytes", "Bytes stored in each tier of this node.", labels=["node", "tier"]
        )
        capacity = GaugeMetricFamily(
            "strata_tier_capacity_bytes", "Capacity of each tier of this node.", labels=["node", "tier"]
        )
        for name, usage in self.offload.store.usage().items():
            used.add_metric([self.node, name], usage.used_bytes)
            capacity.add_metric([self.node, name], usage.capacity_bytes)
        yield from (
            lookup,
            hits,
            blocks,
            tier_tokens,
            decisions,
            failures,
            lookup_failures,
            deadlines,
            uncached,
            store,
            unverified,
            used,
            capacity,
        )
        yield from self._eviction(counts)

    def _eviction(self, counts: Mapping[str, int]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        evictions = CounterMetricFamily(
            "strata_evictions",
            "Blocks evicted from this node's tiers to make room at write-back, by tier and reason "
            "(pressure: the tier was full; quota: the namespace was over its quota; ttl: idle past the TTL).",
            labels=["node", "tier", "reason"],
        )
        refused = CounterMetricFamily(
            "strata_write_back_refused",
            "Write-backs refused because nothing in the tier (or the namespace's quota) could be evicted.",
            labels=["node", "tier", "reason"],
        )
        failed = CounterMetricFamily(
            "strata_eviction_failures",
            "Evictions whose delete failed (the disk or the store erring): the block stayed in its tier, "
            "and a later eviction tries it again.",
            labels=["node", "tier"],
        )
        for name, value in sorted(counts.items()):
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "eviction":
                evictions.add_metric([self.node, parts[1], parts[2]], value)
            elif len(parts) == 3 and parts[0] == "write_back_refused":
                refused.add_metric([self.node, parts[1], parts[2]], value)
            elif len(parts) == 2 and parts[0] == "eviction_failed":
                failed.add_metric([self.node, parts[1]], value)
        yield from (evictions, refused, failed)
        yield from self._blend(counts)

    def _blend(self, counts: Mapping[str, int]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Fragment reuse: reused tokens by kind, recomputed tokens, quality samples, and per
        namespace the current r, the fallback state and the samples behind them."""
        reused = CounterMetricFamily(
            "strata_reused_tokens",
            "Prompt positions whose KV came from the cache, by kind "
            "(prefix: exact leading blocks; fragment: blocks matched elsewhere in the prompt, "
            "recomputed positions included - see strata_blend_recomputed_tokens).",
            labels=["node", "kind"],
        )
        for kind in ("prefix", "fragment"):
            reused.add_metric([self.node, kind], counts.get(f"reused_tokens.{kind}", 0))
        recomputed = CounterMetricFamily(
            "strata_blend_recomputed_tokens", "Fragment tokens recomputed by selective recompute.", labels=["node"]
        )
        recomputed.add_metric([self.node], counts.get("blend.recomputed_tokens", 0))
        requests = CounterMetricFamily(
            "strata_blend_requests", "Requests prefilled with reused fragments.", labels=["node"]
        )
        requests.add_metric([self.node], counts.get("blend.requests", 0))
        samples = CounterMetricFamily(
            "strata_blend_quality_samples",
            "Blended requests compared with a full prefill, "
            "by result (agreed, disagreed, dropped when the checker was busy).",
            labels=["node", "result"],
        )
        for result in ("agreed", "disagreed", "dropped"):
            samples.add_metric([self.node, result], counts.get(f"blend.samples_{result}", 0))
        changes = CounterMetricFamily(
            "strata_blend_adjustments",
            "Auto-tune and operator actions: r raised, fallen "
            "back to prefix-only reuse, blending probed again after a fallback, set or "
            "reset by an operator.",
            labels=["node", "action"],
        )
        for action, counter in (
            ("raised", "ratio_raised"),
            ("fallback", "fallbacks"),
            ("reprobe", "reprobes"),
            ("operator", "operator_changes"),
        ):
            changes.add_metric([self.node, action], counts.get(f"blend.{counter}", 0))
        model = self.model
        tuner = self.tuner
        enabled = GaugeMetricFamily(
            "strata_blend_enabled", "1 where the node reuses fragments (STRATA_BLEND).", labels=["node", "model"]
        )
        enabled.add_metric([self.node, model], 1.0 if tuner is not None else 0.0)
        default = GaugeMetricFamily(
            "strata_blend_default_recompute_percent",
            "Configured recompute ratio r of the model's namespaces without an r of their own (percent).",
            labels=["node", "model"],
        )
        ratio = GaugeMetricFamily(
            "strata_blend_recompute_percent",
            "Current recompute ratio r per namespace (percent of fragment tokens recomputed).",
            labels=["node", "model", "namespace"],
        )
        mode = GaugeMetricFamily(
            "strata_blend_prefix_only",
            "1 where a namespace has fallen back to prefix-only reuse.",
            labels=["node", "model", "namespace"],
        )
        judged = CounterMetricFamily(
            "strata_blend_namespace_samples",
            "Quality samples judged for a namespace, by result (counted afresh when an operator resets the namespace).",
            labels=["node", "model", "namespace", "result"],
        )
        window = GaugeMetricFamily(
            "strata_blend_window_agreement",
            "Share of agreeing samples in a namespace's current window (cleared whenever r or the mode changes).",
            labels=["node", "model", "namespace"],
        )
        if tuner is not None:
            default.add_metric([self.node, model], tuner.default_percent)
            for namespace, state in tuner.snapshot().items():
                labels = [self.node, model, namespace]
                ratio.add_metric(labels, float(state["recompute_percent"]))  # type: ignore[arg-type]
                mode.add_metric(labels, 1.0 if state["mode"] == PREFIX_ONLY else 0.0)
                agreed, total = int(state["agreed"]), int(state["samples"])  # type: ignore[call-overload]
                judged.add_metric([*labels, "agreed"], agreed)
                judged.add_metric([*labels, "disagreed"], total - agreed)
                if state["window_agreement"] is not None:
                    window.add_metric(labels, float(state["window_agreement"]))  # type: ignore[arg-type]
        yield from (reused, recomputed, requests, samples, changes, enabled, default, ratio, mode, judged, window)

    def render(self) -> bytes:
        return generate_latest(self.registry)
