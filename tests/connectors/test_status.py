"""The Strata endpoints of a vLLM node: request timelines newest first, 50 unless a limit asks for
more, a bad limit refused by name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import free_port
from worker.dataplane.connectors.status import StatusServer
from worker.dataplane.node_http.timelines import RECENT
from worker.dataplane.offload_records import RequestTrace


class Metrics:
    """Stands in for the engine's metrics (only /metrics reads them)."""

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
