"""Fragment reuse over the node's HTTP API: segments in the request, the split in the usage, /metrics and
/v1/strata/blend."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import openai
import pytest

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.serving.server import NodeServer


@pytest.fixture
def server(models) -> Iterator[NodeServer]:
    engine = blend_engine(models("tiny"), recompute_percent=20, sample_rate=1.0, min_samples=50)
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="blend-node", admin_key="blend-admin-key").start()
    yield node
    node.stop()
    engine.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0, timeout=60)


def get(server, path: str) -> tuple[int, str]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", path, headers={"Authorization": f"Bearer {server.admin_key}"})
    response = connection.getresponse()
    body = response.read().decode()
    connection.close()
    return response.status, body


def test_fragments_reused_through_the_api_and_reported(client, server):
    passage = tokens(2 * BLOCK_TOKENS, seed=1)
    first = [1, *tokens(4, seed=2), *passage, 7]
    client.completions.create(
        model="tiny", prompt=first, max_tokens=1, extra_body={"segments": [[5, 5 + len(passage)]]}
    )
    second = [1, *tokens(21, seed=3), *passage, *tokens(6, seed=4)]
    answer = client.completions.create(model="tiny", prompt=second, max_tokens=2)
    details = answer.usage.prompt_tokens_details
    assert details.fragment_tokens == 2 * BLOCK_TOKENS
    assert details.recomputed_tokens == round(0.2 * 2 * BLOCK_TOKENS + 0.5)
    assert details.cached_tokens == details.prefix_tokens + details.fragment_tokens - details.recomputed_tokens
    assert server.engine.tuner.drain(timeout=60)

    status, text = get(server, "/metrics")
    assert status == 200
    assert f'strata_reused_tokens_total{{kind="fragment",node="blend-node"}} {2 * BLOCK_TOKENS}.0' in text
    assert 'strata_blend_recompute_percent{model="tiny",namespace="default",node="blend-node"} 20.0' in text
    assert 'strata_blend_quality_samples_total{node="blend-node",result="agreed"}' in text

    status, text = get(server, "/v1/strata/blend")
    report = json.loads(text)
    assert status == 200 and report["enabled"] and report["model"] == "tiny"
    assert report["reused_tokens"]["fragment"] == 2 * BLOCK_TOKENS
    assert report["namespaces"]["default"]["recompute_percent"] == 20.0
    assert report["namespaces"]["default"]["samples"] == 1
    assert sum(report["quality_samples"].values()) == 1

    status, text = get(server, "/v1/strata/requests")
    latest = json.loads(text)["requests"][0]
    assert latest["fragment_tokens"] == 2 * BLOCK_TOKENS and latest["blend"] == "blend"
    assert latest["recompute_ratio"] == pytest.approx(latest["recomputed_tokens"] / latest["fragment_tokens"])


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"segments": [[0, 3], [2, 5]]}, "segments[1]", "inside the previous segment"),
        ({"segments": [[0, 500]]}, "segments[0]", "the prompt's length in tokens"),
        ({"segments": "all"}, "segments", "must be a list"),
        ({"blend": "yes"}, "blend", "blend must be true or false"),
    ],
)
def test_bad_segments_are_refused_naming_the_entry(client, server, extra, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.completions.create(model="tiny", prompt=tokens(30, seed=5), max_tokens=1, extra_body=extra)
    assert caught.value.body["param"] == param
    assert not server.engine.traces  # nothing ran


ADMIN_KEY = "node-admin-key-1"


@pytest.fixture
def operated(models) -> Iterator[NodeServer]:
    """A blend node of a fleet-wide config (entries of other models too), with an admin key and a tenant key."""
    engine = blend_engine(
        models("tiny"),
        recompute_percent=15,
        max_percent=30,
        min_samples=1,
        reprobe_seconds=3600,
        model_percent={"tiny": 12.0, "llama-8b": 50.0},
        namespace_percent={"tiny/rag": 25.0, "llama-8b/legal": 40.0},
    )
    node = NodeServer(
        engine=engine, host="127.0.0.1", port=0, node="operated", api_keys={"tenant-key": "rag"}, admin_key=ADMIN_KEY
    ).start()
    yield node
    node.stop()
    engine.close()


def call(server, method: str, path: str, body: object = None, key: str | None = ADMIN_KEY) -> tuple[int, dict]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    return response.status, payload


def metric(text: str, line_start: str) -> float:
    found = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    assert len(found) == 1, (line_start, found)
    return float(found[0].rsplit(" ", 1)[1])


def test_r_per_model_is_exported_before_any_request(operated):
    status, text = get(operated, "/metrics")
    assert status == 200
    assert metric(text, 'strata_blend_enabled{model="tiny",node="operated"}') == 1.0
    assert metric(text, 'strata_blend_default_recompute_percent{model="tiny",node="operated"}') == 12.0
    assert metric(text, 'strata_blend_recompute_percent{model="tiny",namespace="rag",node="operated"}') == 25.0
    assert metric(text, 'strata_blend_prefix_only{model="tiny",namespace="rag",node="operated"}') == 0.0
    assert 'namespace="legal"' not in text  # another model's entry
    # Fragment positions count recomputed ones too, and the help says so.
    assert "recomputed positions included" in next(
        line for line in text.splitlines() if line.startswith("# HELP strata_reused_tokens_total")
    )
    status, text = get(operated, "/v1/strata/blend")
    report = json.loads(text)
    assert report["default_recompute_percent"] == 12.0
    assert report["settings"]["model_percent"] == {"tiny": 12.0, "llama-8b": 50.0}
    assert report["settings"]["reprobe_seconds"] == 3600 and report["namespaces"]["rag"]["samples"] == 0


def test_an_operator_sets_r_and_resets_a_fallen_back_namespace(operated):
    tuner = operated.engine.tuner
    tuner.record("rag", agree=False, kl=1.0, percent=25.0)  # 25 -> 30 (the ceiling)
    tuner.record("rag", agree=False, kl=1.0, percent=30.0)  # -> prefix-only
    status, text = get(operated, "/metrics")
    assert metric(text, 'strata_blend_prefix_only{model="tiny",namespace="rag",node="operated"}') == 1.0
    assert (
        metric(
            text,
            'strata_blend_namespace_samples_total{model="tiny",namespace="rag",node="operated",result="disagreed"}',
        )
        == 2.0
    )
    assert json.loads(get(operated, "/v1/strata/blend")[1])["namespaces"]["rag"]["reprobe_in_s"] > 3500

    status, answer = call(operated, "POST", "/v1/strata/blend", {"namespace": "rag", "percent": 10})
    assert status == 200, answer
    assert answer["namespace"] == "rag" and answer["mode"] == "blend" and answer["recompute_percent"] == 10.0
    assert tuner.current("rag") == ("blend", 10.0)
    status, text = get(operated, "/metrics")
    assert metric(text, 'strata_blend_recompute_percent{model="tiny",namespace="rag",node="operated"}') == 10.0
    assert metric(text, 'strata_blend_prefix_only{model="tiny",namespace="rag",node="operated"}') == 0.0
    assert metric(text, 'strata_blend_adjustments_total{action="operator",node="operated"}') == 1.0

    status, answer = call(operated, "POST", "/v1/strata/blend", {"namespace": "rag", "reset": True})
    assert status == 200 and answer["recompute_percent"] == 25.0 and answer["samples"] == 0
    # A namespace without entries resets to the model's r.
    status, answer = call(operated, "POST", "/v1/strata/blend", {"namespace": "chat", "reset": True})
    assert status == 200 and answer["recompute_percent"] == 12.0


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"percent": 10}, "namespace", "namespace is required"),
        ({"namespace": 7, "percent": 10}, "namespace", "namespace is required"),
        ({"namespace": "-rag", "percent": 10}, "namespace", "is not a namespace name"),
        ({"namespace": "tiny/rag", "percent": 10}, "namespace", "without a model name"),
        ({"namespace": "rag"}, "percent", "give either percent"),
        ({"namespace": "rag", "percent": 10, "reset": True}, "reset", "give either percent"),
        ({"namespace": "rag", "reset": False}, "percent", "give either percent"),
        ({"namespace": "rag", "reset": "yes"}, "reset", "reset must be true or false"),
        ({"namespace": "rag", "percent": 150}, "percent", "percent: must be between 0 and 100 percent"),
        ({"namespace": "rag", "percent": "10"}, "percent", "percent: must be a number of percent"),
        ({"namespace": "rag", "percent": True}, "percent", "percent: must be a number of percent"),
        ({"namespace": "rag", "percent": 10, "ratio": 0.1}, "ratio", "unknown field(s) ratio"),
    ],
)
def test_bad_operator_input_is_refused_naming_the_field(operated, body, param, message):
    status, answer = call(operated, "POST", "/v1/strata/blend", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"]
    assert operated.engine.tuner.current("rag") == ("blend", 25.0)


@pytest.mark.parametrize(
    ("key", "status", "message"),
    [
        (None, 401, "only with the node's admin key"),
        ("wrong", 401, "only with the node's admin key"),
        ("tenant-key", 401, "only with the node's admin key"),
    ],
)
def test_operator_controls_need_the_admin_key(operated, key, status, message):
    answer_status, answer = call(operated, "POST", "/v1/strata/blend", {"namespace": "rag", "percent": 1}, key=key)
    assert answer_status == status and message in answer["error"]["message"]
    assert operated.engine.tuner.current("rag") == ("blend", 25.0)


def test_operator_controls_are_off_without_an_admin_key(models):
    engine = blend_engine(models("tiny"), recompute_percent=20)
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="no-admin").start()
    try:
        status, answer = call(node, "POST", "/v1/strata/blend", {"namespace": "default", "percent": 1}, key="anything")
        assert status == 403 and "STRATA_NODE_ADMIN_KEY" in answer["error"]["message"]
    finally:
        node.stop()
        engine.close()


def test_the_admin_key_cannot_be_a_tenant_key(models):
    engine = blend_engine(models("tiny"))
    with pytest.raises(ValueError, match="node_admin_key: the admin key is also a tenant's API key"):
        NodeServer(engine=engine, host="127.0.0.1", port=0, node="n", api_keys={"k": "rag"}, admin_key="k")
    engine.close()
