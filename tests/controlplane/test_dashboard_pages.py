"""Dashboard pages and their JSON API: login and roles, the overview snapshot and its alerts, block
search by fingerprint, and request timelines and cache counters read from a real engine server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import openai
import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.dashboard.selectors import requests_summary
from controlplane.directory.models import Node, Placement
from controlplane.directory.services import TierReport, node_heartbeat, nodes_mark_stale
from tests.engine.conftest import engine_for, make_store, models, redis_url  # noqa: F401 - fixtures
from worker.dataplane.serving.server import NodeServer

PAGES = ["/", "/nodes/", "/blocks/", "/requests/", "/policies/", "/movements/"]


def _user(name: str, group: str | None) -> User:
    user = User.objects.create_user(username=name, password="pw-12345678")
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


def _client(name: str, group: str | None) -> Client:
    client = Client()
    client.force_login(_user(name, group))
    return client


def _api(name: str, group: str) -> APIClient:
    client = APIClient()
    client.force_authenticate(_user(name, group))
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("path", PAGES)
def test_pages_need_a_login_and_a_role(client, path):
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert _client(f"none{len(path)}", None).get(path).status_code == 403


@pytest.mark.django_db
@pytest.mark.parametrize("path", PAGES)
def test_viewer_pages_carry_no_edit_controls_and_operator_pages_do(path):
    viewer = _client("viewer", "viewer").get(path)
    assert viewer.status_code == 200
    assert b'data-can-edit="false"' in viewer.content
    assert b'data-edit="' not in viewer.content
    operator = _client("operator", "operator").get(path)
    assert operator.status_code == 200 and b'data-can-edit="true"' in operator.content
    # Every page is served with its scripts from this site (no CDN), the charting library included.
    assert b"/static/vendor/uplot/uPlot.iife.min.js" in operator.content
    assert b"https://" not in operator.content


@pytest.mark.django_db
def test_dashboard_api_needs_a_login():
    anonymous = APIClient()
    for path in (
        "/api/v1/dashboard/overview/",
        "/api/v1/dashboard/cache/",
        "/api/v1/requests/",
        "/api/v1/dashboard/blocks/?key=" + str(uuid.uuid4()),
    ):
        assert anonymous.get(path).status_code == 401, path


def _node(name: str, *, used: int, capacity: int = 1000, available: bool = True, tier: str = "host") -> Node:
    return node_heartbeat(
        name=name,
        host="h",
        heartbeat_seconds=1.0,
        address="",
        tiers=[TierReport(tier=tier, capacity_bytes=capacity, used_bytes=used, available=available)],
    )


@pytest.mark.django_db
def test_overview_matches_the_nodes_api_and_raises_alerts(directory_objects):
    _node("calm", used=100)
    _node("full", used=990)
    _node("broken", used=0, available=False)
    _node("late", used=10)
    nodes_mark_stale(now=timezone.now() + timedelta(seconds=60))
    Node.objects.exclude(name="late").update(state="up")
    block = directory_objects["block"]
    Placement.objects.filter(block=block).update(state="corrupt")

    api = _api("viewer", "viewer")
    overview = api.get("/api/v1/dashboard/overview/").json()
    nodes = {n["name"]: n for n in api.get("/api/v1/nodes/").json()["results"]}
    for node in overview["nodes"]:
        assert [(t["tier"], t["used_bytes"], t["capacity_bytes"]) for t in node["tiers"]] == [
            (t["tier"], t["used_bytes"], t["capacity_bytes"]) for t in nodes[node["name"]]["tiers"]
        ]
    host = next(t for t in overview["tiers"] if t["tier"] == "host")
    assert host == {
        "tier": "host",
        "used_bytes": 100 + 990 + 10 + directory_objects["host_used"],
        "capacity_bytes": 3000 + directory_objects["host_capacity"],
        "nodes": 3 + 1,
    }
    kinds = {(a["kind"], a["node"]) for a in overview["alerts"]}
    assert ("watermark", "full") in kinds
    assert ("tier-unavailable", "broken") in kinds
    assert ("stale-node", "late") in kinds
    assert ("corrupt-blocks", directory_objects["node"]) in kinds
    assert ("watermark", "calm") not in kinds
    assert isinstance(overview["seq"], int) and overview["mode"] is not None


@pytest.fixture
def directory_objects(db):
    """A namespace, a model profile, a node and one registered block with a host copy."""
    from controlplane.directory.services import (
        blocks_register,
        modelprofile_create,
        namespace_create,
    )
    from worker.dataplane.directory import BlockRegistration

    namespace_create(name="tenant")
    profile = modelprofile_create(name="llama", model_id="m", layers=2, kv_heads=2, head_dim=4, block_tokens=16)
    _node("holder", used=512, capacity=4096)
    key, content = uuid.uuid4(), uuid.uuid4()
    blocks_register(
        registrations=[
            BlockRegistration(
                namespace="tenant",
                model_key=profile.model_key,
                prefix_key=key,
                content_key=content,
                position=0,
                tokens=16,
                tier="host",
                node="holder",
                nbytes=512,
                checksum="",
                locator="",
                offset=0,
                priority="default",
            )
        ]
    )
    from controlplane.directory.models import Block

    return {
        "block": Block.objects.get(prefix_key=key),
        "prefix_key": key,
        "content_key": content,
        "node": "holder",
        "host_used": 512,
        "host_capacity": 4096,
    }


@pytest.mark.django_db
def test_block_search_by_either_fingerprint_and_its_errors(directory_objects):
    api = _api("viewer", "viewer")
    for key in (directory_objects["prefix_key"], directory_objects["content_key"]):
        found = api.get(f"/api/v1/dashboard/blocks/?key={key}").json()["results"]
        assert [b["id"] for b in found] == [directory_objects["block"].id]
    assert api.get(f"/api/v1/dashboard/blocks/?key={uuid.uuid4()}").json() == {"results": []}
    bad = api.get("/api/v1/dashboard/blocks/?key=not-a-key")
    assert bad.status_code == 400 and "key" in bad.json()
    missing = api.get("/api/v1/dashboard/blocks/")
    assert missing.status_code == 400 and "key" in missing.json()


@pytest.fixture
def engine_server(models, make_store) -> Iterator[NodeServer]:  # noqa: F811 - fixtures imported above
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("device", "host")), write_back_tier="host", keep_in_device=True)
    server = NodeServer(engine=engine, host="127.0.0.1", port=0, node="serving", admin_key=NODE_ADMIN_KEY).start()
    yield server
    server.stop()


NODE_ADMIN_KEY = "pages-node-admin-key"


@pytest.mark.django_db(transaction=True)
def test_requests_and_cache_counters_come_from_the_engine_servers(engine_server, settings):
    settings.STRATA_NODE_ADMIN_KEY = NODE_ADMIN_KEY
    node_heartbeat(
        name="serving",
        host="h",
        heartbeat_seconds=1.0,
        address=engine_server.address,
        tiers=[TierReport(tier="host", capacity_bytes=1000, used_bytes=0)],
    )
    node_heartbeat(
        name="gone",
        host="h",
        heartbeat_seconds=1.0,
        address="127.0.0.1:9",
        tiers=[TierReport(tier="host", capacity_bytes=1000, used_bytes=0)],
    )
    client = openai.OpenAI(base_url=f"http://{engine_server.address}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "Tiered caches keep prefill short. " * 8
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0

    api = _api("viewer", "viewer")
    answer = api.get("/api/v1/requests/").json()
    assert [t["node"] for t in answer["requests"]] == ["serving", "serving"]
    latest = answer["requests"][0]
    assert latest["cached_tokens"] == cached and len(latest["layer_stall_s"]) == 2
    assert sum(latest["hit_blocks_by_tier"].values()) * 16 == cached
    errors = {n["node"]: n["error"] for n in answer["nodes"]}
    assert errors["serving"] == "" and "unreachable" in errors["gone"] and "127.0.0.1:9" in errors["gone"]
    summary = answer["summary"]
    assert summary["cached_tokens"] == cached
    assert summary["computed_tokens"] == 2 * second.usage.prompt_tokens - cached
    only = api.get("/api/v1/requests/?node=serving").json()
    assert [n["node"] for n in only["nodes"]] == ["serving"]

    stats = api.get("/api/v1/dashboard/cache/").json()
    assert stats["lookup_tokens"] == 2 * second.usage.prompt_tokens
    assert stats["hit_tokens"] == cached
    assert sum(stats["hit_tokens_by_tier"].values()) == pytest.approx(cached)
    bad = api.get("/api/v1/requests/?node=not a slug")
    assert bad.status_code == 400 and "node" in bad.json()

    # A control plane without the nodes' admin key is told so, per node.
    settings.STRATA_NODE_ADMIN_KEY = "not-the-nodes-key"
    refused = api.get("/api/v1/requests/?node=serving").json()
    assert refused["requests"] == [] and "set STRATA_NODE_ADMIN_KEY" in refused["nodes"][0]["error"]


@pytest.mark.django_db(transaction=True)
def test_the_nodes_evictions_by_reason_reach_the_dashboard(models, make_store, settings):  # noqa: F811
    settings.STRATA_NODE_ADMIN_KEY = NODE_ADMIN_KEY
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",), blocks=4), write_back_tier="host")
    server = NodeServer(engine=engine, host="127.0.0.1", port=0, node="tight", admin_key=NODE_ADMIN_KEY).start()
    try:
        node_heartbeat(
            name="tight",
            host="h",
            heartbeat_seconds=1.0,
            address=server.address,
            tiers=[TierReport(tier="host", capacity_bytes=1000, used_bytes=0)],
        )
        client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in range(3):  # three prompts of 4 blocks each into a pool of 4 blocks
            client.completions.create(model="tiny", prompt=[(seed * 97 + i) % 500 + 1 for i in range(64)], max_tokens=1)
        engine.counters.add("remote_unverified", 2)  # two loads refused an unregistered L3 copy
        stats = _api("viewer", "viewer").get("/api/v1/dashboard/cache/?node=tight").json()
        assert stats["evictions_by_reason"]["pressure"] == engine.counters.get("eviction.host.pressure") > 0
        assert stats["write_backs_refused"] == 0
        assert stats["nodes"][0]["evictions_by_reason"] == stats["evictions_by_reason"]
        assert stats["remote_unverified"] == stats["nodes"][0]["remote_unverified"] == 2
        # The overview shows it beside the evictions (overview.js fills it from these counters).
        assert b'id="remote-unverified"' in _client("viewer-u", "viewer").get("/").content
    finally:
        server.stop()


def test_saved_time_is_cached_tokens_times_measured_prefill_per_token_less_loading():
    traces = [
        {"prompt_tokens": 100, "cached_tokens": 0, "prefill_s": 1.0, "load_s": 0.0},
        {"prompt_tokens": 100, "cached_tokens": 80, "prefill_s": 0.2, "load_s": 0.05},
    ]
    summary = requests_summary(traces)
    assert summary["computed_tokens"] == 120
    assert summary["prefill_seconds_per_token"] == pytest.approx(1.2 / 120)
    assert summary["saved_seconds"] == pytest.approx(80 * 0.01 - 0.05)
    assert requests_summary([])["saved_seconds"] is None


@pytest.mark.django_db
def test_the_policies_page_has_a_quotas_panel_editable_by_operators_only():
    viewer = _client("viewer-q", "viewer").get("/policies/").content.decode()
    assert 'id="quota-table"' in viewer and '<th scope="col" class="num">Used</th>' in viewer
    assert 'id="quota-form"' not in viewer
    operator = _client("operator-q", "operator").get("/policies/").content.decode()
    assert 'data-edit="namespace-quota"' in operator
    for tier in ("host", "disk", "remote"):
        assert f'<option value="{tier}">' in operator.split('id="nq-tier"')[1].split("</select>")[0]
    assert '<option value="device">' not in operator.split('id="nq-tier"')[1].split("</select>")[0]
