"""The Strata endpoints of a vLLM node: request timelines newest first, 50 unless a limit asks for
more, a bad limit refused by name; fragment reuse's report and operator controls behind the admin
key, a bad body refused by name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import free_port
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.tuner import BlendTuner
from worker.dataplane.connectors.status import Blending, StatusServer
from worker.dataplane.counters import Counters
from worker.dataplane.node_http.timelines import RECENT
from worker.dataplane.offload_records import RequestTrace


class Offload:
    def __init__(self) -> None:
        self.counters = Counters()


class Metrics:
    """Stands in for the engine's metrics (/metrics renders them, /v1/strata/blend reads the counters)."""

    def __init__(self) -> None:
        self.offload = Offload()

    def render(self) -> bytes:
        return b"# no metrics\n"


@pytest.fixture
def server() -> Iterator[StatusServer]:
    traces = [RequestTrace(request_id=f"r{i}", namespace="default", prompt_tokens=i) for i in range(120)]
    served = StatusServer(
        metrics=Metrics(), traces=lambda: traces, node="n0", host="127.0.0.1", port=free_port(), admin_key=ADMIN
    ).start()  # type: ignore[arg-type]
    yield served
    served.stop()


ADMIN = "status-admin-key"


def _get(server: StatusServer, path: str, key: str | None = ADMIN) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_requests_come_newest_first_and_a_limit_asks_for_more(server):
    status, body = _get(server, "/v1/strata/requests")
    assert status == 200 and body["node"] == "n0"
    assert [r["request_id"] for r in body["requests"]] == [f"r{i}" for i in range(119, 119 - RECENT, -1)]
    status, body = _get(server, "/v1/strata/requests?limit=500")
    assert status == 200 and len(body["requests"]) == 120 and body["requests"][-1]["request_id"] == "r0"
    assert [r["request_id"] for r in _get(server, "/v1/strata/requests?limit=2")[1]["requests"]] == ["r119", "r118"]


@pytest.mark.parametrize("limit", ["0", "-3", "ten", ""])
def test_a_bad_limit_is_refused_naming_it(server, limit):
    status, body = _get(server, f"/v1/strata/requests?limit={limit}")
    assert status == 400
    assert (
        body["error"]["message"].startswith("limit must be a whole number") and repr(limit) in body["error"]["message"]
    )


def test_request_timelines_need_the_admin_key_and_metrics_do_not(server):
    for key in (None, "wrong"):
        status, body = _get(server, "/v1/strata/requests", key=key)
        assert status == 401 and "only with the node's admin key" in body["error"]["message"]
    with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as answer:
        assert answer.status == 200


def _send(
    server: StatusServer, body: bytes, key: str = ADMIN, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address}/v1/strata/blend",
        method="POST",
        data=body,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_fragment_reuse_is_reported_and_changed_with_the_admin_key_only(server):
    assert _get(server, "/v1/strata/blend")[0] == 503  # the connector has not said yet
    options = BlendOptions(recompute_percent=15.0)
    server.blending = Blending(model="m", options=options)
    status, report = _get(server, "/v1/strata/blend")
    assert status == 200 and report["enabled"] is False and report["settings"]["recompute_percent"] == 15.0
    status, body = _send(server, json.dumps({"namespace": "rag", "percent": 20}).encode())
    assert status == 409 and "fragment reuse is off" in body["error"]["message"]

    counters = Counters()
    tuner = BlendTuner(options=options, full_prefill=None, counters=counters, model="m")
    server.blending = Blending(model="m", options=options, tuner=tuner)
    server.metrics.offload.counters.add("reused_tokens.fragment", 300)
    server.metrics.offload.counters.add("blend.recomputed_tokens", 45)
    for key in (None, "wrong"):
        assert _get(server, "/v1/strata/blend", key=key)[0] == 401
        assert _send(server, b"{}", key=key or "")[0] == 401
    status, state = _send(server, json.dumps({"namespace": "rag", "percent": 30}).encode())
    assert status == 200 and state["recompute_percent"] == 30 and state["mode"] == "blend" and state["node"] == "n0"
    status, report = _get(server, "/v1/strata/blend")
    assert report["enabled"] is True and report["namespaces"]["rag"]["recompute_percent"] == 30
    assert report["recompute_ratio"] == pytest.approx(0.15)
    status, state = _send(server, json.dumps({"namespace": "rag", "reset": True}).encode())
    assert status == 200 and state["recompute_percent"] == 15.0
    assert counters.snapshot()["blend.operator_changes"] == 2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"not json", None, "not valid JSON"),
        (b"[1]", None, "a JSON object"),
        (b'{"namespace": "rag", "percent": 101}', "percent", "101"),
        (b'{"namespace": "rag", "ratio": 5}', "ratio", "unknown field(s) ratio"),
        (b'{"percent": 5}', "namespace", "namespace is required"),
        (b'{"namespace": "rag", "percent": 5, "reset": true}', "reset", "not both"),
        (b'{"namespace": "m/rag", "percent": 5}', "namespace", "without a model name"),
    ],
)
def test_a_bad_blend_decision_is_refused_by_name_and_changes_nothing(server, body, param, words):
    options = BlendOptions()
    tuner = BlendTuner(options=options, full_prefill=None, counters=Counters(), model="m")
    server.blending = Blending(model="m", options=options, tuner=tuner)
    status, answer = _send(server, body)
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"]
    assert tuner.snapshot() == {}
