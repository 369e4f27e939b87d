"""The connector's stats for vLLM's /metrics: the stats class vLLM carries (empty, aggregated,
reduced, reset, plain data through vLLM's msgpack), the scheduler half's tap (what grew since vLLM
last asked), and the families they land in on vLLM's Prometheus registry."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker.dataplane.connectors.vllm.stats import FAMILIES, StatsTap, StrataConnectorStats, StrataPromMetrics, exported
from worker.dataplane.counters import Counters


def stats(counts: dict[str, int] | None = None, loads=(), stalls=()) -> StrataConnectorStats:
    return StrataConnectorStats(
        data={"counts": dict(counts or {}), "load_seconds": list(loads), "stall_seconds": list(stalls)}
    )


def test_stats_start_empty_aggregate_reduce_and_reset():
    empty = StrataConnectorStats()
    assert empty.is_empty() and empty.reduce() == {}
    assert stats({"hit_blocks.host": 0}).is_empty()  # a counter that did not grow is nothing
    assert not stats(loads=[0.01]).is_empty()

    one = stats({"hit_blocks.host": 2, "load_failures": 1}, loads=[0.010], stalls=[0.002])
    other = stats({"hit_blocks.host": 3, "write_back.host.stored": 4}, loads=[0.030])
    assert one.aggregate(other) is one
    assert one.data["counts"] == {"hit_blocks.host": 5, "load_failures": 1, "write_back.host.stored": 4}
    assert one.reduce() == {
        "hit_blocks.host": 5,
        "load_failures": 1,
        "write_back.host.stored": 4,
        "loads": 2,
        "avg load (ms)": 20.0,
        "avg stall (ms)": 2.0,
    }
    assert other.data["counts"] == {"hit_blocks.host": 3, "write_back.host.stored": 4}  # left as it was
    one.reset()
    assert one.is_empty() and one.reduce() == {}


def test_stats_travel_as_plain_data_and_build_a_copy():
    sent = stats({"hit_blocks.disk": 7}, loads=[0.5])
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent.to_dict()))
    built = StrataConnectorStats.build(received)
    assert built.data == sent.data
    built.aggregate(stats({"hit_blocks.disk": 1}))
    assert received["counts"] == {"hit_blocks.disk": 7}  # vLLM's dict is not changed under it
    assert StrataConnectorStats.build(None).is_empty()


def test_the_tap_gives_what_grew_since_vllm_last_asked():
    counters, worker = Counters(), Counters()

    def read() -> dict[str, int]:
        total = counters.snapshot()
        for name, value in worker.snapshot().items():
            total[name] = total.get(name, 0) + value
        return total

    tap = StatsTap(read, block_tokens=128)
    assert tap.take() is None
    counters.add("hit_blocks.host", 3)
    counters.add("hit_tokens", 300)
    counters.add("decision.load")  # not exported: never shipped
    worker.add("host.corrupt")
    tap.loaded(0.02, [0.001, 0.002])
    tap.loaded(0.5, [])  # outside the step: no stall
    first = tap.take()
    assert first is not None
    assert first.data["counts"] == {
        "hit_blocks.host": 3,
        "hit_tier_tokens.host": 3 * 128,
        "hit_tokens": 300,
        "host.corrupt": 1,
    }
    assert first.data["load_seconds"] == [0.02, 0.5] and first.data["stall_seconds"] == pytest.approx([0.003])
    assert tap.take() is None
    counters.add("hit_blocks.host")
    second = tap.take()
    assert second is not None
    assert second.data["counts"] == {"hit_blocks.host": 1, "hit_tier_tokens.host": 128}


@pytest.mark.parametrize(
    ("counter", "family", "labels"),
    [
        ("hit_blocks.disk", "vllm:strata_hit_blocks", ("disk",)),
        ("hit_tier_tokens.remote", "vllm:strata_hit_tier_tokens", ("remote",)),
        ("hit_tokens", "vllm:strata_hit_tokens", ()),
        ("lookup_deadlines", "vllm:strata_lookup_deadlines", ()),
        ("remote.corrupt", "vllm:strata_corrupt_blocks", ("remote",)),
        ("write_back.host.stored", "vllm:strata_saved_blocks", ("host",)),
        ("write_back.host.full", "vllm:strata_dropped_saves", ("full",)),
        ("write_back.incomplete", "vllm:strata_dropped_saves", ("incomplete",)),
        ("write_back.poisoned", "vllm:strata_dropped_saves", ("poisoned",)),
        ("uncached.unplaced", "vllm:strata_uncached_requests", ("unplaced",)),
        ("write_back.inline", "vllm:strata_inline_saves", ()),
        ("eviction.disk.ttl", "vllm:strata_evictions", ("disk", "ttl")),
        ("uncached.field.kv_hints", "vllm:strata_uncached_requests", ("field.kv_hints",)),
        ("reused_tokens.fragment", "vllm:strata_reused_tokens", ("fragment",)),
        ("blend.requests", "vllm:strata_blend_requests", ()),
        ("blend.recomputed_tokens", "vllm:strata_blend_recomputed_tokens", ()),
        ("blend.failures", "vllm:strata_blend_failures", ()),
        ("blend.samples_disagreed", "vllm:strata_blend_quality_samples", ("disagreed",)),
        ("blend.fallbacks", "vllm:strata_blend_adjustments", ("fallbacks",)),
    ],
)
def test_each_counter_lands_in_its_family(counter, family, labels):
    found = exported(counter)
    assert found is not None and (found[0].name, found[1]) == (family, labels)


@pytest.mark.parametrize(
    "counter", ["decision.load", "store.hits.host", "eviction.unreported", "hit_tokens_x", "blend.samples_queued"]
)
def test_other_counters_stay_off_vllm_s_metrics(counter):
    assert exported(counter) is None


def registry_types(registry: CollectorRegistry) -> dict:
    def bound(base):
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prometheus_families_count_per_engine():
    registry = CollectorRegistry()
    engines = {0: ["model", "0"], 1: ["model", "1"]}
    prom = StrataPromMetrics(
        SimpleNamespace(kv_transfer_config=None), registry_types(registry), ["model_name", "engine"], engines
    )
    engine0, engine1 = {"model_name": "model", "engine": "0"}, {"model_name": "model", "engine": "1"}
    assert registry.get_sample_value("vllm:strata_load_failures_total", engine0) == 0.0  # shown before any load
    sent = stats({"hit_blocks.host": 4, "hit_tokens": 512, "write_back.host.stored": 2}, loads=[0.02], stalls=[0.001])
    prom.observe(sent.to_dict(), engine_idx=0)
    prom.observe(stats({"hit_blocks.host": 1}).to_dict(), engine_idx=1)
    prom.observe(stats({"hit_blocks.host": 1}).to_dict(), engine_idx=0)
    assert registry.get_sample_value("vllm:strata_hit_blocks_total", {**engine0, "tier": "host"}) == 5
    assert registry.get_sample_value("vllm:strata_hit_blocks_total", {**engine1, "tier": "host"}) == 1
    assert registry.get_sample_value("vllm:strata_hit_tokens_total", engine0) == 512
    assert registry.get_sample_value("vllm:strata_saved_blocks_total", {**engine0, "tier": "host"}) == 2
    assert registry.get_sample_value("vllm:strata_load_seconds_count", engine0) == 1
    assert registry.get_sample_value("vllm:strata_load_stall_seconds_sum", engine0) == pytest.approx(0.001)
    names = {metric.name for metric in registry.collect()}
    assert {family.name for family in FAMILIES} <= names
