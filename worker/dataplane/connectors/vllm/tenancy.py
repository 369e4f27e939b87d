"""Which namespace a vLLM request belongs to, from an identity the operator controls.

A namespace carries quotas, accounting, the blend ratio and directory isolation, so it comes
from something a client cannot simply claim:

1. the tenant's API key (`api_keys`: key=namespace pairs), or the header a trusted gateway in
   front of vLLM sets (`namespace_header`), read by `NamespaceMiddleware` in vLLM's API server
   (`--middleware worker.dataplane.connectors.vllm.tenancy.NamespaceMiddleware`; a node that
   launches vLLM adds it when either is set). The middleware writes the namespace into the
   request's kv_transfer_params with a tag, an HMAC of it under the node's `namespace_secret`,
   which the connector in vLLM's engine checks: a client cannot forge the tag;
2. else, only where the operator turned it on (`client_namespaces`), the namespace a client
   names in kv_transfer_params.strata_namespace: then any client can name any namespace (its
   quota, its eviction), but never read its blocks without its cache salt;
3. else `default_namespace`.

A cache salt is not a namespace: it is a tenant's secret, mixed into the block keys
(`requests.scope_of`); any string vLLM accepts, registered nowhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

NAMESPACE_PARAM = "strata_namespace"
"""The key of kv_transfer_params naming a request's namespace."""
TAG_PARAM = "strata_namespace_tag"
"""The key of kv_transfer_params holding the middleware's tag of that namespace."""
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def check_namespace(name: object, *, what: str) -> str:
    """`name` when it is a namespace name (1-63 letters, digits, '.', '_', '-'); ValueError naming
    `what` otherwise."""
    if not isinstance(name, str) or not _NAMESPACE_RE.match(name):
        raise ValueError(f"{what}: namespace {name!r} must be 1-63 letters, digits, '.', '_' or '-'")
    return name


def namespace_tag(secret: str, namespace: str) -> str:
    """The tag that vouches for `namespace` (HMAC-SHA256 under the node's namespace secret)."""
    return hmac.new(secret.encode(), namespace.encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class NamespacePolicy:
    """How the connector decides a request's namespace (the node's options of the same names)."""

    default_namespace: str = "default"
    client_namespaces: bool = False
    namespace_secret: str = ""

    def namespace_of(self, kv_transfer_params: object) -> str:
        """The namespace of a request whose kv_transfer_params are `kv_transfer_params`: a tagged
        one (the middleware's), else the client's claim where allowed, else the default. A claim
        that is no namespace name is a ValueError naming it."""
        params = kv_transfer_params if isinstance(kv_transfer_params, Mapping) else {}
        claimed = params.get(NAMESPACE_PARAM)
        if claimed is None:
            return self.default_namespace
        tag = params.get(TAG_PARAM)
        if self.namespace_secret and isinstance(tag, str) and isinstance(claimed, str):
            if hmac.compare_digest(tag, namespace_tag(self.namespace_secret, claimed)):
                return check_namespace(claimed, what=f"kv_transfer_params.{NAMESPACE_PARAM}")
        if self.client_namespaces:
            return check_namespace(claimed, what=f"kv_transfer_params.{NAMESPACE_PARAM}")
        return self.default_namespace


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Identities:
    """What the middleware maps to namespaces: tenants' API keys, and a trusted gateway's header."""

    api_keys: Mapping[str, str]
    namespace_header: str
    namespace_secret: str

    def __post_init__(self) -> None:
        if (self.api_keys or self.namespace_header) and not self.namespace_secret:
            raise ValueError(
                "namespace_secret: needed to vouch for the namespaces of api_keys and namespace_header "
                "(set STRATA_NAMESPACE_SECRET to the same random value for vLLM's API server and engine)"
            )
        for key, namespace in self.api_keys.items():
            check_namespace(namespace, what=f"api_keys ({key[:4]}...)")

    def namespace(self, headers: Mapping[str, str]) -> tuple[str | None, str]:
        """(namespace, "") for a request these identities place, (None, "") for one they do not,
        (None, reason) for one to refuse: an API key that is no tenant's, or none where keys are set."""
        auth = headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if self.api_keys:
            for tenant_key, namespace in self.api_keys.items():
                if key and hmac.compare_digest(key.encode(), tenant_key.encode()):
                    return namespace, ""
            return None, "unknown API key" if key else "an API key is required (Authorization: Bearer KEY)"
        if self.namespace_header:
            value = headers.get(self.namespace_header.lower())
            if value:
                try:
                    return check_namespace(value, what=self.namespace_header), ""
                except ValueError as exc:
                    return None, str(exc)
        return None, ""


class NamespaceMiddleware:
    """ASGI middleware for vLLM's API server: writes the namespace of each request's identity (API
    key or gateway header, see `Identities`) into the JSON body's kv_transfer_params, tagged for
    the connector; refuses a request with an unknown API key (401) or a malformed gateway
    header (400), naming why. Only POSTs under /v1/ are placed (the requests that run the
    model); bodies it does not place pass unchanged."""

    def __init__(self, app: ASGIApp, identities: Identities | None = None) -> None:
        self.app = app
        if identities is None:
            from worker.dataplane.config import load_config

            config = load_config()
            identities = Identities(
                api_keys=dict(config.api_keys),
                namespace_header=config.namespace_header,
                namespace_secret=config.namespace_secret,
            )
        self.identities = identities

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or not str(scope.get("path", "")).startswith("/v1/")
        ):
            await self.app(scope, receive, send)  # no request to place (a GET of /v1/models, /metrics, ...)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        namespace, refusal = self.identities.namespace(headers)
        if refusal:
            status = 401 if self.identities.api_keys else 400
            await _refuse(send, status, refusal)
            return
        if namespace is None:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        rewritten = _with_namespace(bytes(body), namespace, self.identities.namespace_secret)
        headers_out = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers_out.append((b"content-length", str(len(rewritten)).encode()))
        await self.app(
            {**scope, "headers": headers_out},
            _replay([{"type": "http.request", "body": rewritten, "more_body": False}], then=receive),
            send,
        )


def _with_namespace(body: bytes, namespace: str, secret: str) -> bytes:
    """The JSON body with kv_transfer_params naming `namespace`, tagged (any claim replaced);
    a body that is not a JSON object passes unchanged (the server answers it as it would)."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return body
    if not isinstance(payload, dict):
        return body
    params = payload.get("kv_transfer_params")
    params = dict(params) if isinstance(params, dict) else {}
    params[NAMESPACE_PARAM] = namespace
    params[TAG_PARAM] = namespace_tag(secret, namespace)
    payload["kv_transfer_params"] = params
    return json.dumps(payload).encode()


def _replay(messages: list[MutableMapping[str, Any]], then: Receive | None = None) -> Receive:
    pending = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive


async def _refuse(send: Send, status: int, message: str) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
