"""/metrics of the control plane, the node discovery Prometheus reads, and the Grafana dashboard
checked against the metrics the code really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.directory.services import TierReport, node_heartbeat, node_mark_down

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFINITION = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|CounterMetricFamily|GaugeMetricFamily|HistogramMetricFamily)\(\s*"
    r"\"(strata_[a-z0-9_]+)\""
)
QUERIED = re.compile(r"\bstrata_[a-z0-9_]+\b")


def exported_names() -> dict[str, str]:
    """Every series name the code can expose, mapped to the file that defines it."""
    names: dict[str, str] = {}
    for path in [*(REPO_ROOT / "controlplane").rglob("*.py"), *(REPO_ROOT / "worker").rglob("*.py")]:
        for kind, name in DEFINITION.findall(path.read_text()):
            where = str(path.relative_to(REPO_ROOT))
            if kind.startswith("Counter"):
                base = name.removesuffix("_total")
                names[base + "_total"] = where
            elif kind.startswith("Histogram") or kind == "Summary":
                for suffix in ("_bucket", "_sum", "_count"):
                    names[name + suffix] = where
            else:
                names[name] = where
    return names


def grafana_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "strata.json").read_text())
    queries = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [(a["name"], a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return queries


def test_every_metric_grafana_queries_is_exported_by_the_code():
    exported = exported_names()
    queries = grafana_queries()
    assert len(queries) >= 25
    missing = sorted(
        {(title, name) for title, expr in queries for name in QUERIED.findall(expr) if name not in exported}
    )
    assert not missing, f"panels query metrics no code exports: {missing}"


def test_the_dashboard_covers_what_operators_watch():
    queried = {name for _, expr in grafana_queries() for name in QUERIED.findall(expr)}
    assert {
        "strata_tier_used_bytes",
        "strata_tier_capacity_bytes",
        "strata_node_up",
        "strata_lookup_tokens_total",
        "strata_hit_tokens_total",
        "strata_hit_tier_tokens_total",
        "strata_load_seconds_bucket",
        "strata_layer_stall_seconds_bucket",
        "strata_ttft_seconds_bucket",
        "strata_blocks_moved_total",
        "strata_evictions_total",
        "strata_checksum_failures_total",
    } <= queried
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "strata.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]


@pytest.mark.django_db
def test_control_plane_metrics_match_the_directory(client):
    node_heartbeat(
        name="m-up",
        host="h",
        heartbeat_seconds=1.0,
        address="127.0.0.1:9101",
        tiers=[
            TierReport(tier="host", capacity_bytes=4096, used_bytes=1024),
            TierReport(tier="disk", capacity_bytes=8192, used_bytes=0, available=False),
        ],
    )
    node_heartbeat(
        name="m-down",
        host="h",
        heartbeat_seconds=1.0,
        address="127.0.0.1:9102",
        tiers=[TierReport(tier="host", capacity_bytes=10, used_bytes=0)],
    )
    node_mark_down(name="m-down")
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }
    assert samples[("strata_tier_used_bytes", (("node", "m-up"), ("tier", "host")))] == 1024
    assert samples[("strata_tier_capacity_bytes", (("node", "m-up"), ("tier", "host")))] == 4096
    assert samples[("strata_tier_available", (("node", "m-up"), ("tier", "disk")))] == 0
    assert samples[("strata_tier_available", (("node", "m-up"), ("tier", "host")))] == 1
    assert samples[("strata_node_up", (("node", "m-up"), ("state", "up")))] == 1
    assert samples[("strata_node_up", (("node", "m-down"), ("state", "down")))] == 0
    assert 0 <= samples[("strata_node_heartbeat_age_seconds", (("node", "m-up"),))] < 60
    assert samples[("strata_policy_version", ())] >= 1
    assert sum(v for (name, _), v in samples.items() if name == "strata_mode_active") == 1
    # Every series the control plane job's panels ask for is in this answer.
    rendered = {name for name, _ in samples}
    for _, expr in grafana_queries():
        if 'job="strata-controlplane"' in expr:
            for name in QUERIED.findall(expr):
                assert name in rendered, f"{name} not in the control plane's /metrics"


@pytest.mark.django_db
def test_prometheus_discovers_the_engine_servers_of_nodes_not_down(client):
    node_heartbeat(name="sd-a", host="h", heartbeat_seconds=1.0, address="10.0.0.1:9100", tiers=[])
    node_heartbeat(name="sd-b", host="h", heartbeat_seconds=1.0, address="", tiers=[])
    node_heartbeat(name="sd-c", host="h", heartbeat_seconds=1.0, address="10.0.0.3:9100", tiers=[])
    node_mark_down(name="sd-c")
    answer = client.get("/metrics/nodes")
    assert answer.status_code == 200
    assert answer.json() == [{"targets": ["10.0.0.1:9100"], "labels": {"node": "sd-a"}}]


@pytest.mark.django_db
def test_prometheus_discovers_vllm_s_own_metrics_beside_a_vllm_node_s_strata_endpoints(client):
    node_heartbeat(
        name="sd-v",
        host="h",
        heartbeat_seconds=1.0,
        address="10.0.0.4:10100",
        tiers=[],
        engine="vllm",
        engine_address="10.0.0.4:9100",
    )
    answer = client.get("/metrics/nodes")
    assert answer.json() == [
        {"targets": ["10.0.0.4:10100"], "labels": {"node": "sd-v"}},
        {"targets": ["10.0.0.4:9100"], "labels": {"node": "sd-v", "exporter": "vllm"}},
    ]


@pytest.mark.django_db
def test_a_heartbeat_names_an_engine_strata_knows():
    with pytest.raises(ValueError, match="engine: expected one of strata, vllm, got 'sglang'"):
        node_heartbeat(name="sd-x", host="h", heartbeat_seconds=1.0, tiers=[], engine="sglang")
