"""The node's OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models.

Requests queue for the one engine (a lock inside it); streaming answers use server-sent events.
Besides: /metrics (anyone who reaches the node: counters only, no prompt, salt or key),
/v1/strata/requests (the node's admin key, or a tenant's API key for its own requests) and
/v1/strata/blend (the admin key: its GET reports and its POST changes fragment reuse)."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from worker.dataplane.engine.engine import Engine, RequestTrace
from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.node_http import access, timelines
from worker.dataplane.node_http import blend as blend_http
from worker.dataplane.serving.fields import ApiError, check_unicode, float_field, int_field, stop_field

log = logging.getLogger("strata.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
NAMESPACE_HEADER = "X-Strata-Namespace"


class NodeServer:
    """Serves one engine over HTTP on a background thread."""

    def __init__(
        self,
        *,
        engine: Engine,
        host: str,
        port: int,
        node: str,
        api_keys: Mapping[str, str] | None = None,
        served_name: str | None = None,
        admin_key: str = "",
        namespace_header: str = "",
        client_namespaces: bool = False,
        default_namespace: str = "default",
    ) -> None:
        self.engine = engine
        self.node = node
        self.api_keys = dict(api_keys or {})
        self.namespace_header = namespace_header
        """A header a trusted gateway sets to name the namespace ("" for none)."""
        self.client_namespaces = client_namespaces
        """Whether a client may name its namespace itself (X-Strata-Namespace)."""
        self.default_namespace = default_namespace
        if admin_key and admin_key in self.api_keys:
            # A tenant holding it could then change every tenant's settings.
            raise ValueError("node_admin_key: the admin key is also a tenant's API key (api_keys)")
        self.admin_key = admin_key
        self.model_name = served_name or engine.model.name
        self.metrics = EngineMetrics(engine.offload, node, model=engine.model.name, tuner=engine.tuner)
        previous = engine.on_trace
        engine.on_trace = self._chain(previous)
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=f"server-{node}", daemon=True)

    def _chain(self, previous: Callable[[RequestTrace], None] | None) -> Callable[[RequestTrace], None]:
        def on_trace(trace: RequestTrace) -> None:
            self.metrics.observe(trace)
            if previous is not None:
                previous(trace)

        return on_trace

    @property
    def address(self) -> str:
        # A TCP server's address: (host, port), plus flow info and scope id for IPv6.
        host, port = cast(tuple[str, int], self.httpd.server_address[:2])
        return f"{host}:{port}"

    def start(self) -> NodeServer:
        self.thread.start()
        log.info("node %s serves model %s at http://%s/v1", self.node, self.model_name, self.address)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    # -- request handling -------------------------------------------------------------------
    def namespace_of(self, headers: Message) -> str:
        """A request's namespace, from an identity the operator controls: its API key (api_keys),
        else the header a trusted gateway sets (namespace_header), else the client's own
        X-Strata-Namespace where the operator allows it (client_namespaces), else the default. A
        client naming a namespace the node does not take from clients is refused, not quietly
        moved to another namespace."""
        key = access.bearer(headers)
        asked = headers.get(NAMESPACE_HEADER)
        if self.api_keys:
            if key not in self.api_keys:
                raise ApiError(
                    HTTPStatus.UNAUTHORIZED, "unknown API key", kind="authentication_error", code="invalid_api_key"
                )
            namespace = self.api_keys[key]
            if asked and asked != namespace:
                raise ApiError(
                    HTTPStatus.FORBIDDEN,
                    f"this API key belongs to namespace {namespace!r}, not {asked!r}",
                    kind="permission_error",
                )
            return namespace
        if self.namespace_header and (trusted := headers.get(self.namespace_header)):
            return self._checked(self.namespace_header, trusted)
        if asked:
            if not self.client_namespaces:
                raise ApiError(
                    HTTPStatus.FORBIDDEN,
                    f"{NAMESPACE_HEADER}: this node does not take namespaces from clients (STRATA_CLIENT_NAMESPACES "
                    "is off); a namespace comes from an API key or a trusted gateway's header",
                    kind="permission_error",
                )
            return self._checked(NAMESPACE_HEADER, asked)
        return self.default_namespace

    @staticmethod
    def _checked(header: str, namespace: str) -> str:
        if not namespace.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(namespace) > 63:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{header} must be 1-63 letters, digits, '-', '_' or '.'")
        return namespace

    def check_admin(self, headers: Message) -> None:
        """Operator controls need the node's admin key; tenants' API keys do not open them."""
        access.require_admin(headers, admin_key=self.admin_key, what="operator controls")

    def blend_control(self, body: Mapping[str, Any], headers: Message) -> tuple[HTTPStatus, dict[str, Any]]:
        """An operator's blend decision for one namespace (`node_http.blend.control`)."""
        self.check_admin(headers)
        status, answer = blend_http.control(body, node=self.node, model=self.engine.model.name, tuner=self.engine.tuner)
        if status == HTTPStatus.OK:
            log.info(
                "node %s namespace %s: blend %s by an operator",
                self.node,
                answer["namespace"],
                "reset" if body.get("reset") else f"r set to {answer['recompute_percent']}%",
            )
        return status, answer

    def blend_report(self) -> dict[str, Any]:
        """Fragment reuse of this node: settings, counters, and the state of every namespace."""
        engine = self.engine
        return blend_http.report(
            node=self.node,
            model=engine.model.name,
            tuner=engine.tuner,
            options=engine.blend_options,
            counts=engine.counters.snapshot(),
        )

    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(HTTPStatus.BAD_REQUEST, "model is required", param="model")
        if model != self.model_name:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"model {model!r} is not served here; this node serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        model = self.engine.model
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", param="messages")
            clean = []
            for i, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] needs a role", param="messages")
                content = message.get("content")
                if isinstance(content, list):
                    parts = [part.get("text", "") for part in content if isinstance(part, dict)]
                    if not all(isinstance(part, str) for part in parts):
                        raise ApiError(
                            HTTPStatus.BAD_REQUEST,
                            f"messages[{i}].content: each part's text must be text",
                            param="messages",
                        )
                    content = "".join(parts)
                if not isinstance(content, str):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].content must be text", param="messages")
                check_unicode(content, f"messages[{i}].content", param="messages")
                check_unicode(message["role"], f"messages[{i}].role", param="messages")
                clean.append({"role": message["role"], "content": content})
            return model.encode_chat(clean)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(HTTPStatus.BAD_REQUEST, "prompt cannot be empty", param="prompt")
            check_unicode(prompt, "prompt", param="prompt")
            return model.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = model.model.config.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
            return list(prompt)
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "prompt must be a string or a list of token ids (one prompt per request)",
            param="prompt",
        )

    def run(
        self, body: Mapping[str, Any], headers: Message, chat: bool, emit: Callable[[str], None] | None
    ) -> dict[str, Any]:
        namespace = self.namespace_of(headers)  # who asks, before anything about what they asked
        self.check_model(body)
        prompt = self.prompt_ids(body, chat)
        max_tokens = int_field(
            body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", 16, minimum=1
        )
        temperature = float_field(body, "temperature", 1.0 if "temperature" in body else 0.0, minimum=0.0, maximum=2.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64):
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"seed must be an integer from -2**63 to 2**64-1, got {seed!r}", param="seed"
            )
        if body.get("n", 1) != 1:
            raise ApiError(HTTPStatus.BAD_REQUEST, "n must be 1 (one choice per request)", param="n")
        stops = stop_field(body)
        segments = body.get("segments")
        blend = body.get("blend")
        if blend is not None and not isinstance(blend, bool):
            raise ApiError(HTTPStatus.BAD_REQUEST, "blend must be true or false", param="blend")
        context = self.engine.model.max_context
        if len(prompt) + max_tokens > context:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context of {context} tokens",
                param="max_tokens" if len(prompt) < context else "prompt",
                code="context_length_exceeded",
            )
        model = self.engine.model
        produced: list[int] = []
        sent = [0]

        def on_token(token: int) -> bool:
            produced.append(token)
            text = model.decode(produced)
            for stop in stops:
                at = text.find(stop)
                if at >= 0:
                    if emit is not None and at > sent[0]:
                        emit(text[sent[0] : at])
                        sent[0] = at
                    return True
            # Hold back a possible start of a stop string and an unfinished UTF-8 sequence.
            safe = len(text) - max((len(s) - 1 for s in stops), default=0)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if emit is not None and safe > sent[0]:
                emit(text[sent[0] : safe])
                sent[0] = safe
            return False

        eos = model.eos_token_id
        try:
            result = self.engine.generate(
                prompt,
                max_tokens=max_tokens,
                namespace=namespace,
                on_token=on_token,
                stop_ids=[eos] if eos is not None and not body.get("ignore_eos") else [],
                temperature=temperature,
                seed=seed,
                segments=segments,
                blend=blend,
            )
        except ValueError as exc:
            # The engine names the field (e.g. "namespace: no namespace named 'x'").
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), param=str(exc).split(":", 1)[0]) from exc
        output = result.output_ids
        if output and eos is not None and output[-1] == eos and result.trace.finish_reason == "stop":
            output = output[:-1]
        text = model.decode(output)
        for stop in stops:
            if stop in text:
                text = text[: text.index(stop)]
        if emit is not None and len(text) > sent[0]:
            emit(text[sent[0] :])
        return {
            "text": text,
            "finish_reason": result.trace.finish_reason,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(result.output_ids),
                "total_tokens": len(prompt) + len(result.output_ids),
                "prompt_tokens_details": {
                    "cached_tokens": result.trace.cached_tokens,
                    "prefix_tokens": result.trace.prefix_tokens,
                    "fragment_tokens": result.trace.fragment_tokens,
                    "recomputed_tokens": result.trace.recomputed_tokens,
                },
            },
            "trace": result.trace,
        }


class _Handler(BaseHTTPRequestHandler):
    app: NodeServer
    protocol_version = "HTTP/1.1"
    server_version = "strata-node"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: HTTPStatus | int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        url = urllib.parse.urlsplit(self.path)
        if self.path == "/v1/models":
            self._send_json(
                HTTPStatus.OK,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.app.model_name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "strata",
                            "max_model_len": self.app.engine.model.max_context,
                        }
                    ],
                },
            )
        elif self.path == "/metrics":
            data = self.app.metrics.render()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif url.path == timelines.PATH:
            try:
                reader = access.timeline_reader(self.headers, admin_key=self.app.admin_key, api_keys=self.app.api_keys)
            except access.Denied as exc:
                self._send_json(exc.status, exc.body)
                return
            answer = timelines.requests_answer(
                url.query, node=self.app.node, traces=list(self.app.engine.traces), namespace=reader
            )
            self._send_json(*answer)
        elif self.path == blend_http.PATH:
            try:
                access.require_admin(self.headers, admin_key=self.app.admin_key, what="the fragment-reuse report")
            except access.Denied as exc:
                self._send_json(exc.status, exc.body)
                return
            self._send_json(HTTPStatus.OK, self.app.blend_report())
        elif self.path == "/livez":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send_json(HTTPStatus.NOT_FOUND, ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}").body)

    def do_POST(self) -> None:  # noqa: N802
        if self.path == blend_http.PATH:
            try:
                self._send_json(*self.app.blend_control(self._read_json(), self.headers))
            except (ApiError, access.Denied) as exc:
                self._send_json(exc.status, exc.body)
            return
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        if self.path not in routes:
            self._send_json(HTTPStatus.NOT_FOUND, ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}").body)
            return
        chat = routes[self.path]
        try:
            body = self._read_json()
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(HTTPStatus.BAD_REQUEST, "stream must be true or false", param="stream")
            if stream:
                self._stream(body, chat)
            else:
                answer = self.app.run(body, self.headers, chat, None)
                self._send_json(HTTPStatus.OK, self._envelope(answer, chat))
        except ApiError as exc:
            self._send_json(exc.status, exc.body)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away before the answer was sent")
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("request failed")
            self._send_json(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc}", kind="server_error").body,
            )

    def _read_json(self) -> dict[str, Any]:
        length_text = self.headers.get("Content-Length")
        if length_text is None or not (length_text.isascii() and length_text.isdigit()):
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _envelope(self, answer: dict[str, Any], chat: bool) -> dict[str, Any]:
        created = int(time.time())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": answer["text"]},
                "finish_reason": answer["finish_reason"],
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": answer["text"], "finish_reason": answer["finish_reason"], "logprobs": None}
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.app.model_name,
            "choices": [choice],
            "usage": answer["usage"],
            "system_fingerprint": f"strata-{self.app.node}",
        }

    def _stream(self, body: dict[str, Any], chat: bool) -> None:
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        started = [False]

        def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> None:
            payload: dict[str, Any] = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": self.app.model_name,
                "choices": [choice] if choice else [],
            }
            if usage is not None:
                payload["usage"] = usage
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def start() -> None:
            if started[0]:
                return
            started[0] = True
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if chat:
                chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

        def emit(text: str) -> None:
            start()
            if chat:
                chunk({"index": 0, "delta": {"content": text}, "finish_reason": None})
            else:
                chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

        # Validation errors are answered before any byte of the stream is sent.
        self.app.check_model(body)
        answer = self.app.run(body, self.headers, chat, emit)
        start()
        final = (
            {"index": 0, "delta": {}, "finish_reason": answer["finish_reason"]}
            if chat
            else {"index": 0, "text": "", "finish_reason": answer["finish_reason"], "logprobs": None}
        )
        chunk(final)
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            chunk({}, usage=answer["usage"])
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
