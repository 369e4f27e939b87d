"""Settings of the engine API server: `gunicorn -c python:controlplane.runtime.gunicorn
-b HOST:PORT controlplane.wsgi:application`.

Threaded workers (keep-alive connections, one database connection per thread from the pool the
production settings configure), as many workers as CPUs by default. Environment:
STRATA_API_WORKERS (processes), STRATA_API_THREADS (threads per process),
STRATA_API_TIMEOUT_S (a request running longer has its worker restarted)."""

from __future__ import annotations

import os


def _positive(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected a whole number, got {raw!r}") from None
    if value < 1:
        raise SystemExit(f"{name}: must be at least 1, got {value}")
    return value


worker_class = "gthread"
workers = _positive("STRATA_API_WORKERS", os.cpu_count() or 1)
threads = _positive("STRATA_API_THREADS", 4)
timeout = _positive("STRATA_API_TIMEOUT_S", 60)
graceful_timeout = 30
keepalive = 75  # engines keep one connection open between prompts
proc_name = "strata-api"
errorlog = "-"
loglevel = os.environ.get("STRATA_API_LOG_LEVEL", "info")
accesslog = None  # one line per lookup would drown the log; /metrics counts requests


def when_ready(server: object) -> None:
    addresses = ", ".join(str(listener) for listener in getattr(server, "LISTENERS", []))
    print(
        f"Strata engine API ready on {addresses}: {workers} workers x {threads} threads "
        "(HTTP only; the dashboard's websockets are on daphne)",
        flush=True,
    )
