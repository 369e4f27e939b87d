"""Saves outside the engine step: a step's new blocks are copied out of the engine's pages inside
the step, into buffers bounded by a byte budget; one thread then stores them in the write-back
tier (the copy into the tier and the hashing) and registers them, step after step in the order
they were handed over, while the engine computes the next steps.

The copy out of the pages cannot leave the step: once the step ends, the engine may hand a page
to another request (a preempted request's pages are freed without the connector being asked),
and a copy taken later could hold another request's KV. What is done with the copy can wait.

When the budget is spent (the thread is behind), the caller stores the block inside the step as
it did before: a save is never dropped, and the step never waits longer than that store takes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("strata.vllm")


class SaveQueue:
    """Work that stores saved blocks, run on one thread in the order it was submitted, holding at
    most `budget` bytes of copies while it waits (`reserve` before copying; `submit` hands the
    work over with the bytes it frees when done)."""

    def __init__(self, budget: int, *, name: str = "strata-saves") -> None:
        self.budget = budget
        self.name = name
        self.held = 0
        """Bytes of copies reserved and not yet stored."""
        self._jobs: collections.deque[tuple[Callable[[], None], int]] = collections.deque()
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def reserve(self, nbytes: int) -> bool:
        """Room for `nbytes` more of copies (True: reserved, to be handed to `submit` or `cancel`);
        False when the budget is spent or the queue closed."""
        with self._cv:
            if self._closed or self.held + nbytes > self.budget:
                return False
            self.held += nbytes
            return True

    def hold(self, nbytes: int, *, timeout: float | None = None) -> None:
        """Reserve `nbytes`, waiting for the thread to free room (up to `timeout`; then, or when
        the queue holds nothing, reserved all the same): for work that must be handed over
        whatever the budget, whose waiting holds the caller back instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.held and self.held + nbytes > self.budget:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    log.warning("%s: %d bytes over its budget of %d bytes", self.name, self.held + nbytes, self.budget)
                    break
                self._cv.wait(left)
            self.held += nbytes

    def cancel(self, nbytes: int) -> None:
        """Give back reserved bytes that were not submitted (a copy that failed)."""
        with self._cv:
            self.held -= nbytes
            self._cv.notify_all()

    def submit(self, work: Callable[[], None], nbytes: int) -> None:
        """Run `work` on the queue's thread after everything submitted before; its `nbytes`
        (reserved) are freed when it returns. An error in `work` is logged, never raised here."""
        with self._cv:
            if self._closed:
                self.held -= nbytes
                raise RuntimeError(f"{self.name}: closed, the work was not run")
            self._jobs.append((work, nbytes))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                work, nbytes = self._jobs.popleft()
                self._busy = True
            try:
                work()
            except Exception:  # noqa: BLE001 - the blocks are a future miss, the worker goes on
                log.exception("%s: blocks handed over to be stored were not", self.name)
            finally:
                with self._cv:
                    self.held -= nbytes
                    self._busy = False
                    self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Work submitted and not finished."""
        with self._cv:
            return len(self._jobs) + self._busy

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is done (False: still running at `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish what was submitted (up to `timeout`), then stop the thread; nothing more is
        taken. False: work was still running at the timeout (it is abandoned with the thread)."""
        done = self.drain(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and done:
            thread.join(timeout)
        if not done:
            log.warning("%s: %d saves still running at shutdown were abandoned", self.name, self.pending)
        return done
