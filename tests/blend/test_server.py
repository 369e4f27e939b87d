"""Fragment reuse over the node's HTTP API: segments in the request, the split in the usage, /metrics and /v1/strata/blend."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import openai
import pytest

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.engine.server import NodeServer


@pytest.fixture
def server(models) -> Iterator[NodeServer]:
    engine = blend_engine(models("tiny"), recompute_percent=20, sample_rate=1.0, min_samples=50)
    node = NodeServer(engine=engine, host="127.0.0.1", port=0, node="blend-node").start()
    yield node
    node.stop()
    engine.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0, timeout=60)


def get(server, path: str) -> tuple[int, str]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", path)
    response = connection.getresponse()
    body = response.read().decode()
    connection.close()
    return response.status, body


def test_fragments_reused_through_the_api_and_reported(client, server):
    passage = tokens(2 * BLOCK_TOKENS, seed=1)
    first = [1, *tokens(4, seed=2), *passage, 7]
    client.completions.create(model="tiny", prompt=first, max_tokens=1, extra_body={"segments": [[5, 5 + len(passage)]]})
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
