"""Namespaces of vLLM requests from identities the operator controls: NamespaceMiddleware in vLLM's API
server places requests by API key or trusted header and vouches for them with a tag the connector
checks; a client's own claim counts only where the operator allows it; the node launches vLLM with
the middleware and a secret when it has identities to map. Every route of vLLM's API server is
known to the middleware: those that run the model are behind the tenant's key, and a route it
does not know is refused, never served in a namespace by default."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest

from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.tenancy import (
    MODEL_FREE,
    NAMESPACE_PARAM,
    PLACED,
    TAG_PARAM,
    UNKNOWN,
    UNPLACED,
    Identities,
    NamespaceMiddleware,
    NamespacePolicy,
    Unplaced,
    _router_routes,
    namespace_tag,
    route_kind,
    routes_by_kind,
)
from worker.vllm_server import NAMESPACE_MIDDLEWARE, server_command, server_environ

SECRET = "s3cret"


class App:
    """The ASGI app behind the middleware (vLLM's): what reached it."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] | None = None
        self.body = b""

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.scope = scope
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(
    middleware: NamespaceMiddleware,
    body: bytes,
    headers: dict[str, str],
    *,
    method: str = "POST",
    path: str = "/v1/completions",
):
    sent: list[dict[str, Any]] = []
    chunks = [body[:5], body[5:]]  # a body in two messages, as a server may deliver it

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-length", str(len(body)).encode())],
    }
    await middleware(scope, receive, send)
    return sent


def middleware(**identities: Any) -> tuple[NamespaceMiddleware, App]:
    app = App()
    values = {"api_keys": {}, "namespace_header": "", "namespace_secret": SECRET, **identities}
    return NamespaceMiddleware(app, Identities(**values)), app


REQUEST = {"model": "m", "prompt": [1, 2, 3], "kv_transfer_params": {NAMESPACE_PARAM: "claimed", "other": 1}}


async def test_an_api_key_places_the_request_and_the_tag_vouches_for_it():
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    sent = await call(placing, json.dumps(REQUEST).encode(), {"Authorization": "Bearer key-a"})
    assert sent[0]["status"] == 200
    params = json.loads(app.body)["kv_transfer_params"]
    assert params == {NAMESPACE_PARAM: "tenant-a", TAG_PARAM: namespace_tag(SECRET, "tenant-a"), "other": 1}
    assert dict(app.scope["headers"])[b"content-length"] == str(len(app.body)).encode()
    assert NamespacePolicy(namespace_secret=SECRET).namespace_of(params) == "tenant-a"
    # The tag does not vouch for another namespace, nor under another secret.
    assert NamespacePolicy(namespace_secret=SECRET).namespace_of({**params, NAMESPACE_PARAM: "tenant-b"}) == "default"
    assert NamespacePolicy(namespace_secret="other").namespace_of(params) == "default"


@pytest.mark.parametrize(
    ("headers", "message"),
    [({"Authorization": "Bearer nope"}, "unknown API key"), ({}, "an API key is required")],
)
async def test_without_a_tenant_s_key_the_request_is_refused_by_name(headers, message):
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    sent = await call(placing, json.dumps(REQUEST).encode(), headers)
    assert sent[0]["status"] == 401 and app.scope is None
    assert json.loads(sent[1]["body"])["error"]["message"].startswith(message)


async def test_a_trusted_gateway_header_places_the_request():
    placing, app = middleware(namespace_header="X-Tenant")
    await call(placing, json.dumps(REQUEST).encode(), {"X-Tenant": "tenant-g"})
    assert json.loads(app.body)["kv_transfer_params"][NAMESPACE_PARAM] == "tenant-g"
    # No header: the gateway left it in the default namespace, which the middleware places it in
    # (a client's claim replaced), so that an untagged request means one that carried no params.
    placing, app = middleware(namespace_header="X-Tenant")
    await call(placing, json.dumps(REQUEST).encode(), {})
    assert json.loads(app.body)["kv_transfer_params"][NAMESPACE_PARAM] == "default"
    # A malformed header is refused, naming the header.
    placing, app = middleware(namespace_header="X-Tenant")
    sent = await call(placing, json.dumps(REQUEST).encode(), {"X-Tenant": "not a namespace"})
    assert sent[0]["status"] == 400 and "X-Tenant" in json.loads(sent[1]["body"])["error"]["message"]


async def test_a_body_that_is_not_a_json_object_and_a_get_pass_unchanged():
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    await call(placing, b"[1, 2", {"Authorization": "Bearer key-a"})
    assert app.body == b"[1, 2"
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    sent = await call(placing, b"", {}, method="GET")  # /v1/models and the like need no tenant
    assert sent[0]["status"] == 200


def test_identities_need_a_secret_to_vouch_with():
    with pytest.raises(ValueError, match="namespace_secret"):
        Identities(api_keys={"k": "tenant-a"}, namespace_header="", namespace_secret="")


def test_a_client_claim_counts_only_where_the_operator_allows_it():
    claim = {NAMESPACE_PARAM: "tenant-b"}
    assert NamespacePolicy().namespace_of(claim) == "default"
    assert NamespacePolicy(default_namespace="shared-pool").namespace_of(None) == "shared-pool"
    assert NamespacePolicy(client_namespaces=True).namespace_of(claim) == "tenant-b"
    with pytest.raises(ValueError, match="must be 1-63"):
        NamespacePolicy(client_namespaces=True).namespace_of({NAMESPACE_PARAM: "a b"})


def test_a_node_launches_vllm_with_the_middleware_and_a_secret_when_it_has_identities():
    plain = load_config(overrides={"node_name": "n", "model": "tiny"}, environ={})
    assert NAMESPACE_MIDDLEWARE not in server_command(plain, model="m", dtype="float32")
    assert server_environ(plain, {})["STRATA_NAMESPACE_SECRET"] == ""
    keyed = load_config(overrides={"node_name": "n", "api_keys": "k1=tenant-a,k2=tenant-b"}, environ={})
    command = server_command(keyed, model="m", dtype="float32")
    assert command[command.index("--middleware") + 1] == NAMESPACE_MIDDLEWARE
    environ = server_environ(keyed, {})
    assert environ["STRATA_API_KEYS"] == "k1=tenant-a,k2=tenant-b"
    assert len(environ["STRATA_NAMESPACE_SECRET"]) >= 32
    # The vLLM server's processes read the same identities back from that environment.
    again = load_config(environ=environ)
    assert (again.api_keys, again.namespace_secret) == (keyed.api_keys, environ["STRATA_NAMESPACE_SECRET"])


def vllm_app(tasks: tuple[str, ...]) -> Any:
    """vLLM's API server app for a model of `tasks`, as `vllm serve` builds it (no engine)."""
    import warnings

    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_app(args, tasks)


def vllm_routes() -> set[tuple[str, str]]:
    """Every route of the installed vLLM's API server, for generating and audio models, and the
    routes its pooling models add (vLLM registers those only for a pooling model's config)."""
    import importlib

    from vllm.tasks import SupportedTask

    routes: set[tuple[str, str]] = set()
    for tasks in (("generate",), ("transcription", "realtime")):
        assert set(tasks) <= set(typing.get_args(SupportedTask))
        routes |= set(_router_routes(vllm_app(tasks)))
    for kind in ("pooling", "classify", "embed", "scoring"):
        router = importlib.import_module(f"vllm.entrypoints.pooling.{kind}.api_router").router
        routes |= set(_router_routes(router))
    return routes


def test_every_route_of_vllm_s_api_server_is_known_to_the_middleware():
    """A newer vLLM's new route fails this test (and is refused by a running server) until it is
    placed in `ROUTES`; the routes that run a generating model are placed or named unplaced."""
    routes = vllm_routes()
    kinds = routes_by_kind(sorted(routes))
    assert kinds[UNKNOWN] == []
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /inference/v1/generate"} <= set(kinds[PLACED])
    assert "POST /tokenize" in kinds[MODEL_FREE] and "GET /v1/models" in kinds[MODEL_FREE]
    assert ("POST", "/v1/embeddings") in routes and ("WEBSOCKET", "/v1/realtime") in routes
    assert route_kind("POST", "/v1/responses/resp_123/cancel") == MODEL_FREE
    assert route_kind("POST", "/v2/generate") == UNKNOWN


async def test_a_route_the_middleware_does_not_know_is_refused_naming_it():
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    sent = await call(placing, json.dumps(REQUEST).encode(), {"Authorization": "Bearer key-a"}, path="/v2/generate")
    assert sent[0]["status"] == 404 and app.scope is None
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert message.startswith("POST /v2/generate: a route Strata's namespace mapping does not know")


async def test_a_route_that_runs_the_model_without_kv_transfer_params_checks_the_key_and_passes_the_body():
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    body = json.dumps({"model": "m", "label_token_ids": [1, 2]}).encode()
    sent = await call(placing, body, {}, path="/generative_scoring")
    assert sent[0]["status"] == 401 and app.scope is None
    await call(placing, body, {"Authorization": "Bearer key-a"}, path="/generative_scoring")
    assert app.body == body  # nothing rewritten: the connector serves it uncached (`NamespacePolicy.placed`)


async def test_a_websocket_that_runs_the_model_needs_the_tenant_s_key():
    placing, app = middleware(api_keys={"key-a": "tenant-a"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    await placing(scope, receive, send)
    assert sent == [
        {"type": "websocket.close", "code": 1008, "reason": "an API key is required (Authorization: Bearer KEY)"}
    ]


async def test_the_middleware_lists_vllm_s_routes_at_start(caplog):
    """At the server's start (its lifespan), the routes of the router behind the middleware are
    named by what the middleware does with them, in one line."""
    import logging

    vllm = vllm_app(("generate",))
    placing = NamespaceMiddleware(vllm, Identities({"key-a": "tenant-a"}, "", SECRET))
    kinds = placing.describe_routes()
    assert "POST /v1/chat/completions" in kinds[PLACED] and "POST /generative_scoring" in kinds[UNPLACED]
    assert kinds[UNKNOWN] == []

    class Started:
        routes = vllm.routes
        started = False

        async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
            Started.started = True

    at_start = NamespaceMiddleware(Started(), Identities({"key-a": "tenant-a"}, "", SECRET))  # type: ignore[arg-type]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="strata.vllm"):
        await at_start({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    (line,) = [r.message for r in caplog.records if r.message.startswith("NamespaceMiddleware:")]
    assert Started.started and "POST /v1/completions" in line and line.endswith("0 refused as unknown (-)")


def test_where_identities_are_mapped_an_untagged_request_is_unplaced_never_default():
    policy = NamespacePolicy(namespace_secret=SECRET, placed=True)
    tagged = {NAMESPACE_PARAM: "tenant-a", TAG_PARAM: namespace_tag(SECRET, "tenant-a")}
    assert policy.namespace_of(tagged) == "tenant-a"
    for params in (None, {}, {NAMESPACE_PARAM: "tenant-a"}, {**tagged, TAG_PARAM: "forged"}):
        with pytest.raises(Unplaced, match="no namespace placed by the API server"):
            policy.namespace_of(params)
