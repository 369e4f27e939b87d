"""What a node's traffic looks like over the recent window: arrivals, prompt lengths, queue depth
and device-tier (L1) pressure. The engine records each request; the heartbeat sends the summary,
from which the control plane derives the fleet's shape and the mode it calls for.

Prompt lengths are counted in power-of-two buckets (PROMPT_BUCKETS), so the control plane can ask
for the share over any of those bounds without the node knowing the threshold.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Upper bounds (exclusive) of the prompt-length buckets, in tokens; one last bucket holds the rest.
PROMPT_BUCKETS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_WINDOW_SECONDS = 60.0


def bucket_of(prompt_tokens: int) -> int:
    """Index of the bucket that counts a prompt of `prompt_tokens` tokens."""
    return bisect.bisect_right(PROMPT_BUCKETS, prompt_tokens)


@dataclasses.dataclass(frozen=True)
class TrafficSummary:
    """A node's traffic over the last `window_seconds`: `requests` arrived, their prompt tokens in
    total and by bucket (`prompt_buckets[i]` counts prompts below PROMPT_BUCKETS[i] and at or
    above the bound before; the last counts the rest), requests in flight (`queue_depth`) and the
    device tier's use over its capacity (`l1_pressure`)."""

    window_seconds: float
    requests: int
    prompt_tokens: int
    prompt_buckets: tuple[int, ...]
    queue_depth: int
    l1_pressure: float

    def __post_init__(self) -> None:
        if not isinstance(self.window_seconds, int | float) or self.window_seconds <= 0:
            raise ValueError(f"traffic.window_seconds: must be a number above zero, got {self.window_seconds!r}")
        for name in ("requests", "prompt_tokens", "queue_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"traffic.{name}: must be a whole number of at least 0, got {value!r}")
        buckets = self.prompt_buckets
        if len(buckets) != len(PROMPT_BUCKETS) + 1 or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in buckets
        ):
            raise ValueError(
                f"traffic.prompt_buckets: expected {len(PROMPT_BUCKETS) + 1} whole numbers of at least 0, "
                f"got {buckets!r}"
            )
        if sum(buckets) != self.requests:
            raise ValueError(f"traffic.prompt_buckets: counts add up to {sum(buckets)}, not requests {self.requests}")
        if (
            isinstance(self.l1_pressure, bool)
            or not isinstance(self.l1_pressure, int | float)
            or not 0 <= self.l1_pressure <= 1
        ):
            raise ValueError(f"traffic.l1_pressure: expected a fraction in [0, 1], got {self.l1_pressure!r}")

    def prompts_at_least(self, tokens: int) -> int:
        """Prompts of at least `tokens` tokens; `tokens` must be one of PROMPT_BUCKETS."""
        if tokens not in PROMPT_BUCKETS:
            raise ValueError(f"long_prompt_tokens: must be one of {', '.join(map(str, PROMPT_BUCKETS))}, got {tokens}")
        return sum(self.prompt_buckets[PROMPT_BUCKETS.index(tokens) + 1 :])

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prompt_buckets": list(self.prompt_buckets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrafficSummary:
        if not isinstance(data, Mapping):
            raise ValueError(f"traffic: expected an object, got {type(data).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in fields if name not in data]
        if missing:
            raise ValueError(f"traffic.{missing[0]}: missing")
        extra = sorted(set(data) - set(fields))
        if extra:
            raise ValueError(f"traffic.{extra[0]}: unknown field")
        buckets = data["prompt_buckets"]
        if not isinstance(buckets, Sequence) or isinstance(buckets, str):
            raise ValueError(f"traffic.prompt_buckets: expected a list, got {buckets!r}")
        return cls(**{**data, "prompt_buckets": tuple(buckets)})


class TrafficMeter:
    """Counts arrivals and prompt lengths over a sliding window, and requests in flight. Thread-safe:
    the server's request threads record, the heartbeat thread summarises."""

    def __init__(
        self,
        *,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        pressure: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_seconds <= 0:
            raise ValueError(f"window_seconds: must be above zero, got {window_seconds}")
        self.window_seconds = window_seconds
        self.pressure = pressure
        self.clock = clock
        self._lock = threading.Lock()
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self._in_flight = 0

    def arrive(self, prompt_tokens: int) -> None:
        """A request with a prompt of `prompt_tokens` tokens arrived (and is now in flight)."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: cannot be negative, got {prompt_tokens}")
        with self._lock:
            self._arrivals.append((self.clock(), prompt_tokens))
            self._in_flight += 1
            self._trim()

    def finish(self) -> None:
        """A request in flight finished (answered or failed)."""
        with self._lock:
            self._in_flight = max(self._in_flight - 1, 0)

    def _trim(self) -> None:
        horizon = self.clock() - self.window_seconds
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._arrivals.popleft()

    def summary(self) -> TrafficSummary:
        """The traffic of the last window, with the device tier's pressure read now."""
        with self._lock:
            self._trim()
            buckets = [0] * (len(PROMPT_BUCKETS) + 1)
            for _, tokens in self._arrivals:
                buckets[bucket_of(tokens)] += 1
            tokens = sum(t for _, t in self._arrivals)
            requests, in_flight = len(self._arrivals), self._in_flight
        pressure = min(max(float(self.pressure()), 0.0), 1.0) if self.pressure is not None else 0.0
        return TrafficSummary(
            window_seconds=float(self.window_seconds),
            requests=requests,
            prompt_tokens=tokens,
            prompt_buckets=tuple(buckets),
            queue_depth=in_flight,
            l1_pressure=pressure,
        )
