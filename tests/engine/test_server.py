"""The node server driven by the official `openai` package, streaming included, and its refusals."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import openai
import pytest

from tests.engine.conftest import engine_for
from worker.dataplane.node_http.timelines import RECENT
from worker.dataplane.offload_records import RequestTrace
from worker.dataplane.serving.server import NAMESPACE_HEADER, NodeServer


@pytest.fixture
def server(models, make_store) -> Iterator[NodeServer]:
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("device", "host")), write_back_tier="host", keep_in_device=True)
    node = NodeServer(
        engine=engine, host="127.0.0.1", port=0, node="test-node", admin_key=ADMIN, client_namespaces=True
    ).start()
    yield node
    node.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0, timeout=60)


LONG = "The quick brown fox jumps over the lazy dog. " * 8
ADMIN = "node-admin-key-test"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_then_cached_completion(client):
    first = client.completions.create(model="tiny", prompt=LONG, max_tokens=6)
    assert first.usage.prompt_tokens == len(LONG.encode()) + 1
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=LONG, max_tokens=6)
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens // 16) * 16
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].finish_reason in {"length", "stop"}


def test_streaming_completion_matches_the_plain_one(client):
    plain = client.completions.create(model="tiny", prompt=LONG, max_tokens=10)
    stream = client.completions.create(
        model="tiny", prompt=LONG, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    for event in stream:
        if event.choices:
            text += event.choices[0].text
        if event.usage:
            usage = event.usage
    assert text == plain.choices[0].text
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_chat_plain_and_streaming(client):
    messages = [
        {"role": "system", "content": "You answer briefly. " * 5},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert plain.choices[0].message.role == "assistant"
    parts = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True)
        if chunk.choices
    ]
    assert "".join(parts) == plain.choices[0].message.content
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_namespace_header_isolates_tenants(client):
    prompt = "tenant isolation " * 10
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Strata-Namespace": "a"})
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Strata-Namespace": "b"})
    a = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Strata-Namespace": "a"})
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert a.usage.prompt_tokens_details.cached_tokens > 0


def test_a_namespace_comes_from_an_identity_the_operator_controls(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    prompt = "tenant identity " * 10
    closed = NodeServer(engine=engine, host="127.0.0.1", port=0, node="closed", default_namespace="b").start()
    gateway = NodeServer(engine=engine, host="127.0.0.1", port=0, node="gw", namespace_header="X-Tenant").start()
    try:
        client = openai.OpenAI(base_url=f"http://{closed.address}/v1", api_key="unused", max_retries=0)
        # A client naming its namespace is refused, with the reason, when the node does not take claims.
        with pytest.raises(openai.PermissionDeniedError, match="does not take namespaces from clients"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={NAMESPACE_HEADER: "a"})
        # Without a claim, the node's default namespace ("b" here) holds the request's blocks.
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert engine.traces[-1].namespace == "b"
        # Behind a trusted gateway, its header names the namespace; a malformed one is refused by name.
        through = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0)
        through.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Tenant": "a"})
        assert engine.traces[-1].namespace == "a"
        with pytest.raises(openai.BadRequestError, match="X-Tenant must be 1-63"):
            through.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Tenant": "no!"})
    finally:
        closed.stop()
        gateway.stop()


def test_api_keys_choose_the_namespace(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="keyed", api_keys={"k-a": "tenant-a"}).start()
    try:
        good = openai.OpenAI(base_url=f"http://{node.address}/v1", api_key="k-a", max_retries=0)
        good.completions.create(model="tiny", prompt="hello " * 10, max_tokens=2)
        bad = openai.OpenAI(base_url=f"http://{node.address}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="unknown API key"):
            bad.completions.create(model="tiny", prompt="hello", max_tokens=2)
        with pytest.raises(openai.PermissionDeniedError, match="belongs to namespace 'tenant-a'"):
            good.completions.create(
                model="tiny", prompt="hello", max_tokens=2, extra_headers={"X-Strata-Namespace": "tenant-b"}
            )
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": "gpt-9"}, openai.NotFoundError, "model 'gpt-9' is not served here"),
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens must be at least 1"),
        ({"prompt": "x" * 5000}, openai.BadRequestError, "exceeds the model's context of 4096"),
        ({"temperature": 5}, openai.BadRequestError, "temperature must be between 0.0 and 2.0"),
        ({"prompt": [1, 2, 99999]}, openai.BadRequestError, "token ids must lie in 0..511"),
        ({"stop": [""]}, openai.BadRequestError, "stop must be"),
    ],
)
def test_bad_requests_name_the_problem(client, kwargs, error, message):
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        client.completions.create(**request)


def _raw(server, body: bytes, path="/v1/completions") -> tuple[int, dict]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    return response.status, payload


def test_bad_json_and_unknown_routes(server):
    status, body = _raw(server, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _raw(server, b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = _raw(server, b"{}", path="/v1/embeddings")
    assert status == 404


def test_stop_strings_end_the_answer(client):
    plain = client.completions.create(model="tiny", prompt=LONG, max_tokens=20)
    text = plain.choices[0].text
    assert len(text) >= 4, "the fixed-seed model produces enough text to cut"
    stop = text[2:4]
    cut = client.completions.create(model="tiny", prompt=LONG, max_tokens=20, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_metrics_and_request_timeline(client, server):
    client.completions.create(model="tiny", prompt=LONG, max_tokens=3)
    client.completions.create(model="tiny", prompt=LONG, max_tokens=3)
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    assert 'strata_hit_tokens_total{node="test-node"}' in text
    # Stalls are kept per layer: the tiny model's two layers each have their own series, with
    # one observation each from the second request (the first had nothing cached to wait for).
    for layer in (0, 1):
        assert f'strata_layer_stall_seconds_count{{layer="{layer}",node="test-node"}} 1.0' in text
    assert 'strata_tier_used_bytes{node="test-node",tier="host"}' in text
    connection.request("GET", "/v1/strata/requests", headers=AS_ADMIN)
    timeline = json.loads(connection.getresponse().read())
    latest = timeline["requests"][0]
    assert latest["cached_tokens"] > 0 and len(latest["layer_stall_s"]) == 2
    connection.close()


def _get_json(server: NodeServer, path: str, key: str | None = ADMIN) -> tuple[int, dict]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_request_timelines_take_a_limit(server):
    server.engine.traces.extend(
        RequestTrace(request_id=f"r{i}", namespace="default", prompt_tokens=i) for i in range(RECENT + 10)
    )
    status, body = _get_json(server, "/v1/strata/requests")
    assert status == 200 and body["node"] == "test-node"
    assert [r["request_id"] for r in body["requests"]] == [f"r{i}" for i in range(RECENT + 9, 9, -1)]
    status, body = _get_json(server, "/v1/strata/requests?limit=2")
    assert status == 200 and [r["request_id"] for r in body["requests"]] == [f"r{RECENT + 9}", f"r{RECENT + 8}"]
    status, body = _get_json(server, "/v1/strata/requests?limit=500")
    assert status == 200 and len(body["requests"]) == RECENT + 10 and body["requests"][-1]["request_id"] == "r0"


@pytest.mark.parametrize("limit", ["0", "-3", "ten", ""])
def test_a_bad_request_timeline_limit_is_refused_naming_it(server, limit):
    status, body = _get_json(server, f"/v1/strata/requests?limit={limit}")
    assert status == 400 and body["error"]["param"] == "limit"
    assert (
        body["error"]["message"].startswith("limit must be a whole number") and repr(limit) in body["error"]["message"]
    )


def test_a_node_without_fragment_reuse_says_so(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="plain", admin_key="admin-1").start()
    try:
        host, port = node.address.split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        assert 'strata_blend_enabled{model="tiny",node="plain"} 0.0' in text
        assert "strata_blend_default_recompute_percent{" not in text
        connection.request(
            "POST",
            "/v1/strata/blend",
            body=json.dumps({"namespace": "default", "percent": 5}),
            headers={"Content-Type": "application/json", "Authorization": "Bearer admin-1"},
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 409 and "fragment reuse is off on this node" in answer["error"]["message"]
        connection.close()
    finally:
        node.stop()


def test_request_timelines_need_the_admin_key_or_show_a_tenant_its_own(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="keyed", api_keys=keys, admin_key=ADMIN).start()
    try:
        for key, question in (("key-a", "secret plans of tenant a "), ("key-b", "private notes of tenant b ")):
            tenant = openai.OpenAI(base_url=f"http://{node.address}/v1", api_key=key, max_retries=0)
            tenant.completions.create(model="tiny", prompt=question * 6, max_tokens=2)
        status, body = _get_json(node, "/v1/strata/requests")
        assert status == 200 and {r["namespace"] for r in body["requests"]} == {"tenant-a", "tenant-b"}
        status, body = _get_json(node, "/v1/strata/requests", key="key-a")
        assert status == 200 and [r["namespace"] for r in body["requests"]] == ["tenant-a"]
        for key in (None, "wrong-key"):
            status, body = _get_json(node, "/v1/strata/requests", key=key)
            assert status == 401 and "admin key" in body["error"]["message"]
        # The fragment-reuse report is the operator's: a tenant's key does not open it.
        assert _get_json(node, "/v1/strata/blend", key="key-a")[0] == 401
        assert _get_json(node, "/v1/strata/blend")[0] == 200
        # /metrics stays open, and carries no prompt text, namespace salt or key.
        host, port = node.address.split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/metrics")
        metrics = connection.getresponse().read().decode()
        connection.close()
        secrets = ["secret plans", "private notes", "key-a", "key-b", ADMIN]
        secrets += [engine.fingerprinter(ns).ns_salt.hex() for ns in ("tenant-a", "tenant-b")]
        assert "strata_hit_tokens_total" in metrics
        assert [secret for secret in secrets if secret in metrics] == []
    finally:
        node.stop()


def test_a_node_without_an_admin_key_shows_no_timelines(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="open").start()
    try:
        status, body = _get_json(node, "/v1/strata/requests", key=None)
        assert status == 403 and "set STRATA_NODE_ADMIN_KEY" in body["error"]["message"]
        status, body = _get_json(node, "/v1/strata/blend", key="anything")
        assert status == 403 and "set STRATA_NODE_ADMIN_KEY" in body["error"]["message"]
    finally:
        node.stop()
