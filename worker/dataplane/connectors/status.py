"""The Strata endpoints of an engine Strata does not serve itself (vLLM): /metrics, /v1/strata/requests, /livez.

/metrics and /livez answer anyone who reaches the node; the request timelines need the node's
admin key (`access.timeline_reader`: vLLM's tenants have no Strata API key here).

The control plane reads a node's request timelines and fragment-reuse figures from its address,
and Prometheus scrapes it there, whichever engine serves the model; the engine's own server
(vLLM's OpenAI API, with its own /metrics) stays as it is.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.node_http import access, timelines
from worker.dataplane.offload_records import RequestTrace

log = logging.getLogger("strata.server")


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
            "node %s: Strata metrics and request timelines at http://%s (/metrics, /v1/strata/requests)",
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
        elif path == "/livez":
            self._json(HTTPStatus.OK, {"status": "ok"})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {path}", "type": "not_found_error"}})
