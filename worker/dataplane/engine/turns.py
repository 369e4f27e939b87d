"""Turns at the model: one step runs at a time, and a waiting prefill goes first.

A request is a prefill, then one decode step per token, then a write-back. Running a whole
request under one lock makes a new request wait for every token of the one before it, so its
time to first token is mostly queueing. Taking a turn per step instead lets a new request's
prefill run between two decode steps of another: its first token waits for one step, not for a
whole answer. Decode steps of several requests interleave (no batching). A finished request's
write-back goes first of all: it is short, and until it is done the next request over the same
document cannot find those blocks and would compute them again. Background checks wait until
nothing else is queued. Each step still has the model and the engine's state to itself, as
under one lock."""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator


class Step(enum.IntEnum):
    """What a turn is for, most urgent first."""

    WRITE_BACK = 0
    PREFILL = 1
    DECODE = 2
    BACKGROUND = 3


class Turns:
    """A lock that hands itself to the most urgent waiting step (FIFO within a kind is not
    promised: the operating system picks among waiters of one kind)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._busy = False
        self._waiting = [0] * len(Step)

    @contextlib.contextmanager
    def hold(self, step: Step) -> Iterator[None]:
        with self._changed:
            self._waiting[step] += 1
            try:
                while self._busy or any(self._waiting[:step]):
                    self._changed.wait()
            finally:
                self._waiting[step] -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()

    def waiting(self) -> dict[str, int]:
        """Steps queued now, by kind (for the node's metrics)."""
        with self._changed:
            return {step.name.lower(): self._waiting[step] for step in Step}
