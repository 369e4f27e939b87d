"""Fragment reuse in the dashboard's data: reused tokens split into prefix and fragment, the
recompute ratio, quality samples and the r and fallback state of every (node, model, namespace),
read from real engine servers' /metrics and checked against each node's own /v1/strata/blend."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from controlplane.directory.services import TierReport, node_heartbeat
from tests.blend.conftest import BLOCK_TOKENS, blend_engine, models, tokens  # noqa: F401 - fixture
from worker.dataplane.serving.server import NodeServer

ADMIN = "blend-nodes-admin-key"


@pytest.fixture
def servers(models) -> Iterator[dict[str, NodeServer]]:  # noqa: F811 - the fixture imported above
    """A node reusing fragments under a fleet-wide config, and a node that reuses prefixes only."""
    blending = blend_engine(
        models("tiny"),
        sample_rate=1.0,
        min_samples=1,
        max_percent=30,
        model_percent={"tiny": 12.0, "llama-8b": 50.0},
        namespace_percent={"tiny/rag": 25.0, "legal": 30.0, "llama-8b/chat": 40.0},
    )
    plain = blend_engine(models("tiny"), enabled=False)
    started = {
        "blend-a": NodeServer(engine=blending, host="127.0.0.1", port=0, node="blend-a", admin_key=ADMIN).start(),
        "plain-b": NodeServer(engine=plain, host="127.0.0.1", port=0, node="plain-b", admin_key=ADMIN).start(),
    }
    yield started
    for server in started.values():
        server.stop()
        server.engine.close()


def _viewer() -> APIClient:
    user = User.objects.create_user(username="blend-viewer", password="pw-12345678")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client = APIClient()
    client.force_authenticate(user)
    return client


def _report(server: NodeServer) -> dict:
    request = urllib.request.Request(
        f"http://{server.address}/v1/strata/blend", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.django_db(transaction=True)
def test_fragment_reuse_in_the_dashboard_data_matches_the_nodes(servers, settings):
    settings.STRATA_NODE_ADMIN_KEY = ADMIN
    for name, server in servers.items():
        node_heartbeat(
            name=name,
            host="h",
            heartbeat_seconds=1.0,
            address=server.address,
            tiers=[TierReport(tier="device", capacity_bytes=1000, used_bytes=0)],
        )
    node_heartbeat(name="gone", host="h", heartbeat_seconds=1.0, address="127.0.0.1:9", tiers=[])
    blend_a = servers["blend-a"]
    client = openai.OpenAI(base_url=f"http://{blend_a.address}/v1", api_key="unused", max_retries=0, timeout=60)
    passage = tokens(2 * BLOCK_TOKENS, seed=11)
    client.completions.create(
        model="tiny",
        prompt=[1, *tokens(4, seed=12), *passage, 7],
        max_tokens=1,
        extra_body={"segments": [[5, 5 + len(passage)]]},
    )
    reused = client.completions.create(model="tiny", prompt=[1, *tokens(21, seed=13), *passage, 9], max_tokens=1)
    details = reused.usage.prompt_tokens_details
    assert details.fragment_tokens == 2 * BLOCK_TOKENS and details.recomputed_tokens > 0
    assert blend_a.engine.tuner.drain(timeout=60)
    # Namespace `legal` starts at its configured ceiling, so one poor sample falls it back.
    blend_a.engine.tuner.record("legal", agree=False, kl=1.0, percent=30.0)
    report = _report(blend_a)

    api = _viewer()
    stats = api.get("/api/v1/dashboard/cache/").json()
    nodes = {n["node"]: n for n in stats["nodes"]}
    assert "unreachable" in nodes["gone"]["error"] and "fragment_reuse" not in nodes["gone"]
    mine = nodes["blend-a"]["fragment_reuse"]
    assert mine["enabled"] and mine["model"] == "tiny" and mine["default_recompute_percent"] == 12.0
    assert mine["reused_tokens"] == report["reused_tokens"]
    assert mine["reused_tokens"]["fragment"] == 2 * BLOCK_TOKENS
    assert mine["recomputed_tokens"] == report["recomputed_tokens"] == details.recomputed_tokens
    assert mine["recompute_ratio"] == pytest.approx(details.recomputed_tokens / (2 * BLOCK_TOKENS))
    assert mine["quality_samples"] == report["quality_samples"]
    assert mine["quality_samples"]["agreed"] + mine["quality_samples"]["disagreed"] == 2
    rows = {row["namespace"]: row for row in mine["namespaces"]}
    assert set(rows) == {"default", "rag", "legal"}  # rag: configured, known before any request
    for namespace, row in rows.items():
        state = report["namespaces"][namespace]
        assert row["model"] == "tiny"
        assert row["recompute_percent"] == state["recompute_percent"]
        assert row["prefix_only"] == (state["mode"] == "prefix-only")
        assert row["samples"] == {"agreed": state["agreed"], "disagreed": state["samples"] - state["agreed"]}
        assert row["window_agreement"] == state["window_agreement"]
    assert rows["legal"]["prefix_only"] and rows["legal"]["samples"] == {"agreed": 0, "disagreed": 1}
    assert rows["rag"] == {
        "model": "tiny",
        "namespace": "rag",
        "recompute_percent": 25.0,
        "prefix_only": False,
        "samples": {"agreed": 0, "disagreed": 0},
        "window_agreement": None,
    }

    plain = nodes["plain-b"]["fragment_reuse"]
    assert not plain["enabled"] and plain["default_recompute_percent"] is None and plain["namespaces"] == []
    assert plain["recompute_ratio"] is None

    fleet = stats["fragment_reuse"]
    assert fleet["reused_tokens"] == {
        kind: mine["reused_tokens"][kind] + plain["reused_tokens"][kind] for kind in ("prefix", "fragment")
    }
    assert fleet["recompute_ratio"] == pytest.approx(mine["recompute_ratio"])
    assert fleet["quality_samples"] == mine["quality_samples"]
    assert fleet["nodes"] == [
        {"node": "blend-a", "model": "tiny", "enabled": True, "default_recompute_percent": 12.0},
        {"node": "plain-b", "model": "tiny", "enabled": False, "default_recompute_percent": None},
    ]
    assert [(r["node"], r["namespace"], r["prefix_only"]) for r in fleet["namespaces"]] == [
        ("blend-a", "default", False),
        ("blend-a", "legal", True),
        ("blend-a", "rag", False),
    ]
    only = api.get("/api/v1/dashboard/cache/?node=plain-b").json()
    assert only["fragment_reuse"]["namespaces"] == [] and [n["node"] for n in only["nodes"]] == ["plain-b"]

    summary = api.get("/api/v1/requests/?node=blend-a").json()["summary"]
    assert summary["fragment_tokens"] == 2 * BLOCK_TOKENS
    assert summary["recomputed_tokens"] == details.recomputed_tokens
    assert summary["prefix_tokens"] == details.prefix_tokens
    assert summary["recompute_ratio"] == pytest.approx(details.recomputed_tokens / (2 * BLOCK_TOKENS))
