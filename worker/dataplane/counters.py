"""Thread-safe event counters the store exposes as plain ints (exported to Prometheus elsewhere)."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Named monotonically increasing counters, e.g. ``host.corrupt`` or ``remote.unavailable``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter that has been touched, sorted by name."""
        with self._lock:
            return dict(sorted(self._values.items()))
