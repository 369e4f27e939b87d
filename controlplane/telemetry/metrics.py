"""Prometheus metrics: counters shared by every process (multiprocess mode) and a directory collector."""

from __future__ import annotations

import os
from collections.abc import Iterator

from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane import __version__
from controlplane.directory.choices import NodeState
from controlplane.directory.selectors import nodes_list
from controlplane.movements.collector import MovementsCollector
from controlplane.policies.snapshot import policies_snapshot

READINESS_FAILURES = Counter(
    "strata_readiness_failures_total", "Readiness probes that found a dependency failing, per check.", ["check"]
)
NODE_FETCH_FAILURES = Counter(
    "strata_node_fetch_failures_total",
    "Times the control plane could not read a node's engine server (request timelines, cache counters).",
    ["node"],
)
NODE_ADDRESS_REFUSED = Counter(
    "strata_node_address_refused_total",
    "Times the control plane sent nothing to a node: its reported address is not where its heartbeat came "
    "from nor in STRATA_NODE_ADDRESSES, is not host:port, or its credential is revoked.",
    ["node"],
)


class DirectoryCollector(Collector):
    """Node and tier gauges read from PostgreSQL at scrape time (the database is the truth)."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "strata_node_up", "1 when the node's heartbeats arrive, else 0.", labels=["node", "state"]
        )
        capacity = GaugeMetricFamily("strata_tier_capacity_bytes", "Tier capacity per node.", labels=["node", "tier"])
        used = GaugeMetricFamily("strata_tier_used_bytes", "Tier bytes in use per node.", labels=["node", "tier"])
        heartbeats = CounterMetricFamily(
            "strata_node_heartbeats", "Heartbeats recorded by the control plane, per node.", labels=["node"]
        )
        age = GaugeMetricFamily(
            "strata_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", labels=["node"]
        )
        available = GaugeMetricFamily(
            "strata_tier_available", "1 when the node reports the tier usable, else 0.", labels=["node", "tier"]
        )
        now = timezone.now()
        for node in nodes_list():
            up.add_metric([node.name, node.state], 1.0 if node.state == NodeState.UP else 0.0)
            heartbeats.add_metric([node.name], float(node.heartbeats))
            age.add_metric([node.name], max(0.0, (now - node.last_seen).total_seconds()))
            for tier in node.tiers.all():
                capacity.add_metric([node.name, tier.tier], float(tier.capacity_bytes))
                used.add_metric([node.name, tier.tier], float(tier.used_bytes))
                available.add_metric([node.name, tier.tier], 1.0 if tier.available else 0.0)
        yield up
        yield heartbeats
        yield age
        yield capacity
        yield used
        yield available


class PolicyCollector(Collector):
    """The policy version and the mode in force, so that Grafana can mark policy changes and mode
    switches on every other panel."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snapshot = policies_snapshot()
        version = GaugeMetricFamily("strata_policy_version", "Policy version in force.")
        version.add_metric([], float(snapshot.version))
        mode = GaugeMetricFamily("strata_mode_active", "1 for the mode in force (none: no mode).", labels=["mode"])
        mode.add_metric([snapshot.mode or "none"], 1.0)
        yield version
        yield mode


class BuildCollector(Collector):
    """`strata_build_info{version}`: which Strata a scrape came from (1, the version as a label)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily("strata_build_info", "The running Strata version (always 1).", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info


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
    registry.register(PolicyCollector())
    registry.register(MovementsCollector())
    registry.register(BuildCollector())
    return generate_latest(registry)
