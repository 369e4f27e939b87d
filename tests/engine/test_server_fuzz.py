"""The node server under machine-made bad input (hypothesis): malformed JSON, wrong types, huge and
negative numbers, unicode (lone surrogates too), 1 MiB prompts, on every endpoint. Every answer is
a 4xx that names the problem or a 200, never a 5xx, and the server still answers at once after."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.conftest import engine_for
from worker.dataplane.serving.server import NodeServer

pytestmark = [pytest.mark.slow]
ADMIN = "fuzz-admin-key"
TENANT = "fuzz-tenant-key"
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "n",
    "stop", "stream", "segments", "blend", "namespace", "percent", "reset",
]  # fmt: skip

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800", "\x00", "tiny", "", "🙂" * 10]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.one_of(texts, st.sampled_from(FIELDS)), inner, max_size=5)
    ),
    max_leaves=12,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"]), "max_tokens": st.integers(min_value=-3, max_value=6)},
    optional={
        "prompt": st.one_of(texts, st.lists(st.integers(min_value=-5, max_value=600), max_size=20)),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.one_of(texts, numbers)}, optional={"content": values}), max_size=3
        ),
        "temperature": numbers,
        "seed": numbers,
        "stop": values,
        "stream": st.one_of(st.booleans(), values),
        "segments": values,
        "blend": values,
    },
)

nearly_valid = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=60),
            texts.filter(bool),
            st.lists(st.integers(0, 511), min_size=1, max_size=40),
        ),
        "max_tokens": st.integers(min_value=1, max_value=4),
    },
    optional={
        "temperature": st.one_of(st.floats(0, 2), numbers),
        "seed": st.one_of(st.integers(0, 2**32), numbers),
        "messages_parts": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": values}), max_size=3),
        "stop": st.one_of(st.lists(st.text(min_size=1, max_size=3), max_size=2), values),
        "stream": st.booleans(),
        "blend": st.one_of(st.booleans(), values),
    },
)
keys = st.sampled_from([None, TENANT, TENANT, TENANT, ADMIN, "bad"])


@pytest.fixture(scope="module")
def server(models, tmp_path_factory) -> Iterator[NodeServer]:
    from tests.engine.conftest import layout_for
    from worker.dataplane.store import TieredStore
    from worker.dataplane.tiers.device import DeviceTier

    model = models("tiny")
    layout = layout_for(model)
    store = TieredStore(layout=layout, tiers=[DeviceTier(layout=layout, capacity_bytes=64 * layout.block_bytes)])
    engine = engine_for(model, store, write_back_tier="device")
    node = NodeServer(
        engine=engine, host="127.0.0.1", port=0, node="fuzz", api_keys={TENANT: "tenant"}, admin_key=ADMIN
    ).start()
    yield node
    node.stop()
    store.close()


def _send(server: NodeServer, method: str, path: str, body: bytes | None, key: str | None) -> tuple[int, bytes]:
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _check(status: int, data: bytes) -> None:
    assert status < 500, data[:500]
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"], error


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/strata/blend")]
FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(
    route=st.sampled_from(ROUTES), body=st.one_of(bodies, plausible), key=st.sampled_from([None, TENANT, ADMIN, "bad"])
)
def test_json_bodies_of_any_shape_get_a_4xx_or_an_answer(server, route, body, key):
    method, path = route
    status, data = _send(server, method, path, json.dumps(body, allow_nan=True).encode(), key)
    _check(status, data)


@FUZZ
@given(body=nearly_valid, chat=st.booleans())
def test_nearly_valid_requests_are_served_or_refused_naming_why(server, body, chat):
    parts = body.pop("messages_parts", None)
    if chat:
        content = parts if parts is not None else body.pop("prompt")
        body = {**body, "messages": [{"role": "user", "content": content}]}
        body.pop("prompt", None)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(*_send(server, "POST", path, json.dumps(body).encode(), TENANT))


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    raw=st.one_of(st.binary(max_size=200), texts.map(lambda t: t.encode("utf-8", "surrogatepass"))),
)
def test_bytes_that_are_not_json_get_a_400(server, route, raw):
    status, data = _send(server, *route, raw, ADMIN)
    _check(status, data)


@FUZZ
@given(query=st.text(max_size=30), key=st.sampled_from([None, TENANT, ADMIN, "bad"]))
def test_the_read_endpoints_take_any_query(server, query, key):
    quoted = urllib.parse.quote(query.encode("utf-8", "surrogatepass"), safe="=&")
    for path in ("/v1/strata/requests", "/v1/strata/blend", "/v1/models", "/metrics"):
        status, data = _send(server, "GET", f"{path}?{quoted}&limit={quoted}", None, key)
        assert status < 500, (path, data[:300])


def test_a_one_mebibyte_prompt_is_refused_naming_it_and_the_server_keeps_up(server):
    before = threading.active_count()
    prompt = "x" * (1 << 20)
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}),
    ):
        status, data = _send(server, "POST", path, json.dumps(body).encode(), TENANT)
        assert status == 400 and "context" in json.loads(data)["error"]["message"]
    # A body announced at over 8 MiB is refused before a byte of it is read.
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", str(9 << 20))
    connection.putheader("Authorization", f"Bearer {TENANT}")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "over" in json.loads(response.read())["error"]["message"]
    connection.close()
    # Nothing is left running: the server answers at once, and once the connections' handler
    # threads have returned (each ends a moment after its response is sent) it holds no extra ones.
    status, _ = _send(server, "GET", "/v1/models", None, None)
    assert status == 200
    deadline = time.monotonic() + 10
    while threading.active_count() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before + 1, [thread.name for thread in threading.enumerate()]
    # The fuzzing above reached the engine too, not only the checks in front of it.
    assert any(trace.namespace == "tenant" for trace in server.engine.traces)


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**70}, 400, "seed must be an integer from"),
        ("/v1/completions", {"model": "tiny", "prompt": "\ud800"}, 400, "prompt: not valid unicode"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            400,
            "each part's text must be text",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1e-300}, 200, ""),
    ],
)
def test_what_the_fuzzing_found_stays_fixed(server, path, body, status, message):
    answer, data = _send(server, "POST", path, json.dumps(body).encode(), TENANT)
    assert answer == status and message in data.decode()


def test_digits_that_are_not_numbers_are_refused(server):
    status, data = _send(server, "GET", "/v1/strata/requests?limit=%C2%B2", None, ADMIN)  # "²"
    assert status == 400 and json.loads(data)["error"]["param"] == "limit"
    host, port = server.address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", "\xb2")
    connection.endheaders()
    assert connection.getresponse().status == 411
    connection.close()
