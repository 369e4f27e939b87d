"""Prometheus metrics: counters shared by every process (multiprocess mode) and a directory collector."""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

READINESS_FAILURES = Counter(
    "strata_readiness_failures_total", "Readiness probes that found a dependency failing, per check.", ["check"]
)


class DirectoryCollector(Collector):
    """Node and tier gauges read from PostgreSQL at scrape time (the database is the truth)."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        from controlplane.directory.choices import NodeState
        from controlplane.directory.selectors import nodes_list

        up = GaugeMetricFamily("strata_node_up", "1 when the node's heartbeats arrive, else 0.", labels=["node", "state"])
        capacity = GaugeMetricFamily("strata_tier_capacity_bytes", "Tier capacity per node.", labels=["node", "tier"])
        used = GaugeMetricFamily("strata_tier_used_bytes", "Tier bytes in use per node.", labels=["node", "tier"])
        heartbeats = CounterMetricFamily(
            "strata_node_heartbeats", "Heartbeats recorded by the control plane, per node.", labels=["node"]
        )
        for node in nodes_list():
            up.add_metric([node.name, node.state], 1.0 if node.state == NodeState.UP else 0.0)
            heartbeats.add_metric([node.name], float(node.heartbeats))
            for tier in node.tiers.all():
                capacity.add_metric([node.name, tier.tier], float(tier.capacity_bytes))
                used.add_metric([node.name, tier.tier], float(tier.used_bytes))
        yield up
        yield heartbeats
        yield capacity
        yield used


def render_metrics() -> bytes:
    """The exposition text: multiprocess counters when PROMETHEUS_MULTIPROC_DIR is set, plus the directory."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY

        for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - the default registry's collectors
            registry.register(collector)
    registry.register(DirectoryCollector())
    return generate_latest(registry)
