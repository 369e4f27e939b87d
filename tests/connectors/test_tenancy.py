"""Namespaces of vLLM requests from identities the operator controls: NamespaceMiddleware in vLLM's API
server places requests by API key or trusted header and vouches for them with a tag the connector
checks; a client's own claim counts only where the operator allows it; the node launches vLLM with
the middleware and a secret when it has identities to map."""

from __future__ import annotations

import json
from typing import Any

import pytest

from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.tenancy import (
    NAMESPACE_PARAM,
    TAG_PARAM,
    Identities,
    NamespaceMiddleware,
    NamespacePolicy,
    namespace_tag,
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


async def call(middleware: NamespaceMiddleware, body: bytes, headers: dict[str, str], *, method: str = "POST"):
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
        "path": "/v1/completions",
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
    # No header: the body passes as the client sent it (its claim counts only with client_namespaces).
    placing, app = middleware(namespace_header="X-Tenant")
    await call(placing, json.dumps(REQUEST).encode(), {})
    assert json.loads(app.body) == REQUEST
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
