"""The dashboard's view of finished movements: counts sent as one event per node per interval."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from django.db import connection

from controlplane.node_api import MovementRecord, MovementState, movements_finished_announce

log = logging.getLogger("strata.movements")


class MovementAnnouncer:
    """Sums finished movements and sends one dashboard event per node at most every `every_s`."""

    def __init__(self, node: str, every_s: float = 1.0) -> None:
        self.node = node
        self.every_s = every_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._routes: Counter[str] = Counter()
        self._sent_at = 0.0
        self._timer: threading.Timer | None = None

    def add(self, *movements: MovementRecord) -> None:
        with self._lock:
            for movement in movements:
                self._counts[movement.state] += 1
                if movement.state == MovementState.DONE:
                    self._counts["bytes"] += movement.bytes
                    self._routes[movement.route] += 1
            due = time.monotonic() - self._sent_at >= self.every_s
            if not due and self._timer is None:
                self._timer = threading.Timer(self.every_s, self._flush_later)
                self._timer.daemon = True
                self._timer.start()
        if due:
            self.flush()

    def _flush_later(self) -> None:
        try:
            self.flush()
        finally:
            connection.close()  # this timer thread's own database connection

    def flush(self) -> None:
        with self._lock:
            counts, routes = self._counts, self._routes
            self._counts, self._routes = Counter(), Counter()
            self._sent_at = time.monotonic()
            self._timer = None
        if not counts:
            return
        try:
            movements_finished_announce(
                node=self.node,
                done=counts["done"],
                failed=counts["failed"],
                cancelled=counts["cancelled"],
                nbytes=counts["bytes"],
                routes=dict(routes),
            )
        except Exception as exc:  # noqa: BLE001 - the dashboard stream is lossy by design
            log.warning("movement event not sent: %s", exc)
