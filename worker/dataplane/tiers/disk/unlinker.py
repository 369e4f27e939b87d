"""Background removal of deleted block files, keeping some a while for puts to write over."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from pathlib import Path

from worker.dataplane.tiers.disk.ledger import Ledger

log = logging.getLogger(__name__)

REUSE_DELETED_S = 10.0
"""A deleted block's file is kept this long (under a temporary name, its bytes counted as pending)
before it is unlinked, and a put of this process in that time writes its block over it instead
of creating a file: creating a file, and an O_DIRECT write into its unallocated extents, cost
more than a write over a written file's extents (benchmarks/README.md).
A cache tier deletes and puts all the time (evictions, moves), so most puts reuse a file. A put
takes a kept file before it looks for room, so kept files never make this process refuse one;
other processes sharing the directory see their bytes as used until they go. `drain_deletes`
unlinks them at once. 0 unlinks every deleted file at once."""


class Unlinker:
    """Removes deleted blocks' files in the background, so a move does not wait for the
    filesystem to free each source's extents (slow where it discards them: ext4 `discard`).
    `DiskTier.delete` renames the block to a temporary name (so it is gone at once, and
    `reconcile` of a later process removes it should this one die first) and hands it here; its
    bytes stay counted as pending in the ledger until the unlink is done.

    A file handed over as `reusable` is kept for `keep_s` first: a put in that time takes it
    (`take`) and writes its block over it instead of creating a file (see REUSE_DELETED_S)."""

    def __init__(self, ledger: Ledger, *, tier: str, keep_s: float = 0.0) -> None:
        self._ledger = ledger
        self._tier = tier
        self._keep_s = keep_s
        # (path, size, when it may be unlinked: 0 = at once), oldest first.
        self._queue: collections.deque[tuple[Path, int, float]] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = 0
        self._hurry = 0  # drains under way: everything queued is unlinked at once
        self._closed = False

    def add(self, path: Path, size: int, *, reusable: bool = False) -> None:
        keep = reusable and self._keep_s > 0
        with self._wake:
            if self._closed:
                raise RuntimeError(f"the {self._tier} tier is closed")
            self._queue.append((path, size, time.monotonic() + self._keep_s if keep else 0.0))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"strata-{self._tier}-unlink", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def take(self, size: int) -> Path | None:
        """The oldest kept file of `size` bytes, now the caller's (its bytes still counted as
        pending in the ledger); None when there is none."""
        with self._wake:
            for i, (path, queued_size, due) in enumerate(self._queue):
                if due and queued_size == size:
                    del self._queue[i]
                    self._busy -= 1
                    if not self._busy:
                        self._wake.notify_all()  # for `drain`; the unlink thread needs no wake
                    return path
        return None

    @property
    def busy(self) -> bool:
        """Files handed over are still being removed (or kept for reuse)."""
        return self._busy > 0

    def drain(self) -> None:
        """Return once every file handed over so far is removed, kept ones included."""
        with self._wake:
            self._hurry += 1
            self._wake.notify_all()
            try:
                while self._busy:
                    self._wake.wait()
            finally:
                self._hurry -= 1

    def close(self) -> None:
        self.drain()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _next(self) -> tuple[tuple[Path, int, float] | None, float | None]:
        """The first queued file due now (taken off the queue), else how long until one is."""
        now = time.monotonic()
        for i, entry in enumerate(self._queue):
            if self._hurry or entry[2] <= now:
                del self._queue[i]
                return entry, None
        if not self._queue:
            return None, None
        return None, min(due for _, _, due in self._queue) - now

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    entry, wait = self._next()
                    if entry is not None:
                        break
                    if self._closed and not self._queue:
                        return
                    self._wake.wait(wait)
            path, size, _due = entry
            try:
                # Freeing the extents (the slow part) outside the ledger's lock; the name and its
                # pending bytes then go together under it, so a recount of the ledger (in any
                # process) sees both or neither. The emptied file still reserves its bytes by name.
                os.truncate(path, 0)
                with self._ledger.locked() as state:
                    os.unlink(path)
                    state[1] -= size
            except FileNotFoundError:
                pass  # a reconcile got there first, and recounted the ledger without it
            except OSError as exc:
                # The bytes are still there, under a temporary name: counted as pending while
                # this process lives, removed by the reconcile of the next.
                log.warning(
                    "%s tier: removing the deleted block file %s failed: %s; it is removed "
                    "when the tier is next opened",
                    self._tier,
                    path,
                    exc,
                )
            with self._wake:
                self._busy -= 1
                self._wake.notify_all()
