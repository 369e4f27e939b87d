"""The Strata endpoints of an engine Strata does not serve itself (vLLM): /metrics, /v1/strata/requests,
/v1/strata/blend, /livez.

/metrics and /livez answer anyone who reaches the node; the request timelines and fragment reuse's
report and controls need the node's admin key (`access`: vLLM's tenants have no Strata API key
here).

The control plane reads a node's request timelines and fragment-reuse figures from its address,
and Prometheus scrapes it there, whichever engine serves the model; the engine's own server
(vLLM's OpenAI API, with its own /metrics) stays as it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.tuner import BlendTuner
from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.node_http import access, timelines
from worker.dataplane.node_http import blend as blend_http
from worker.dataplane.offload_records import RequestTrace

log = logging.getLogger("strata.server")


MAX_BODY_BYTES = 64 * 1024
"""The largest operator request body read (a blend decision is a few dozen bytes)."""


@dataclasses.dataclass
class Blending:
    """Fragment reuse as /v1/strata/blend reports and changes it: the model, its options, and the
    tuner (None: fragment reuse is off on this node)."""

    model: str
    options: BlendOptions
    tuner: BlendTuner | None = None


class StatusServer:
    """Serves one engine's Strata metrics and recent request timelines over HTTP on a thread."""

    def __init__(
        self,
        *,
        metrics: EngineMetrics,
        traces: Callable[[], list[RequestTrace]],
        node: str,
        host: str,
        port: int,
        admin_key: str = "",
    ) -> None:
        self.metrics = metrics
        self.admin_key = admin_key
        self.traces = traces
        self.node = node
        self.blending: Blending | None = None
        """Set by the connector: None until then (/v1/strata/blend answers 503)."""
        handler = type("Handler", (_Handler,), {"app": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"status_port: cannot listen on {host}:{port} for the node's Strata endpoints: {exc.strerror}",
            ) from exc
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=f"strata-status-{node}", daemon=True)

    @property
    def address(self) -> str:
        host, port = cast(tuple[str, int], self.httpd.server_address[:2])
        return f"{host}:{port}"

    def start(self) -> StatusServer:
        self.thread.start()
        log.info(
            "node %s: Strata metrics, request timelines and fragment reuse at http://%s (/metrics, "
            "/v1/strata/requests, /v1/strata/blend)",
            self.node,
            self.address,
        )
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    app: StatusServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        if path == "/metrics":
            self._send(HTTPStatus.OK, self.app.metrics.render(), "text/plain; version=0.0.4")
        elif path == timelines.PATH:
            try:
                reader = access.timeline_reader(self.headers, admin_key=self.app.admin_key, api_keys={})
            except access.Denied as exc:
                self._json(exc.status, exc.body)
                return
            self._json(
                *timelines.requests_answer(url.query, node=self.app.node, traces=self.app.traces(), namespace=reader)
            )
        elif path == blend_http.PATH:
            blending = self._blending()
            if blending is not None:
                self._json(
                    HTTPStatus.OK,
                    blend_http.report(
                        node=self.app.node,
                        model=blending.model,
                        tuner=blending.tuner,
                        options=blending.options,
                        counts=self.app.metrics.offload.counters.snapshot(),
                    ),
                )
        elif path == "/livez":
            self._json(HTTPStatus.OK, {"status": "ok"})
        else:
            self._not_found(path)

    def do_POST(self) -> None:  # noqa: N802 - the base class's name
        path = urllib.parse.urlsplit(self.path).path
        if path != blend_http.PATH:
            self._not_found(path)
            return
        blending = self._blending()
        if blending is None:
            return
        body = self._body()
        if body is None:
            return
        status, answer = blend_http.control(body, node=self.app.node, model=blending.model, tuner=blending.tuner)
        if status == HTTPStatus.OK:
            log.info(
                "node %s namespace %s: blend %s by an operator",
                self.app.node,
                answer["namespace"],
                "reset" if body.get("reset") else f"r set to {answer['recompute_percent']}%",
            )
        self._json(status, answer)

    def _not_found(self, path: str) -> None:
        self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {path}", "type": "not_found_error"}})

    def _blending(self) -> Blending | None:
        """Fragment reuse, for a request carrying the admin key; else None, the refusal answered."""
        try:
            access.require_admin(self.headers, admin_key=self.app.admin_key, what="fragment reuse")
        except access.Denied as exc:
            self._json(exc.status, exc.body)
            return None
        if self.app.blending is None:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "fragment reuse: the connector has not started yet", None)
            return None
        return self.app.blending

    def _body(self) -> dict[str, Any] | None:
        """The request's JSON object; None, the refusal answered, for anything else."""
        length = self.headers.get("Content-Length", "")
        if not (length.isascii() and length.isdigit()):
            self._error(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required", None)
            return None
        if int(length) > MAX_BODY_BYTES:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY_BYTES} bytes", None)
            return None
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {exc}", None)
            return None
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "the body must be a JSON object", None)
            return None
        return body

    def _error(self, status: HTTPStatus, message: str, param: str | None) -> None:
        self._json(
            status, {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
        )
