"""Write-through to the shared remote tier (L3): which blocks go there at write-back, and the copy.

A priority class says when its blocks reach L3 (`remote_write`): when the planner demotes them
(on-demotion, the default), or at write-back beside the node's own copy (write-through), so that a
conversation whose next turn lands on another node finds its prefix there at once. The node learns
the classes with the policies in force (`set_classes`); the offload manager registers each
write-back batch and hands it to `submit`, which copies the write-through blocks to L3 on a
background thread (a write-back holds the engine's turn; an L3 write on it would delay the next
request's prefill) and registers the L3 copies once written. The request waits for its copies
after it has let go of the engine's turn and before it answers (`wait`): the client's next turn,
on whichever node, then finds the whole conversation in L3.

The local copy is written first and stays whatever happens to L3: a failed or refused remote write
is counted (`write_through.failed` / `write_through.full`) and logged, and the batch registers the
local copies only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from worker.dataplane.counters import Counters
from worker.dataplane.directory import BlockRegistration
from worker.dataplane.errors import MISSES, TierFull
from worker.dataplane.layout import BlockLayout
from worker.dataplane.store import TieredStore
from worker.dataplane.tier_names import REMOTE

log = logging.getLogger("strata.engine")

ON_DEMOTION = "on-demotion"
WRITE_THROUGH = "write-through"
REMOTE_WRITES = (ON_DEMOTION, WRITE_THROUGH)
DEFAULT_CLASS = "default"
WRITE_ERRORS: tuple[type[Exception], ...] = (*MISSES, OSError, RuntimeError)
"""What a failing read of the local copy or write to L3 raises (counted; the batch goes on)."""


@dataclasses.dataclass(frozen=True)
class RemoteWritePolicy:
    """Which namespaces write through: those of write-through classes, and, when the default class
    writes through, every namespace no other class names."""

    namespaces: frozenset[str] = frozenset()
    default: bool = False
    others: frozenset[str] = frozenset()
    """Namespaces of classes that do not write through (they stay out even when the default does)."""

    @classmethod
    def from_classes(cls, classes: Sequence[Mapping[str, object]]) -> RemoteWritePolicy:
        """From the classes the control plane sends; a class without `remote_write` is on-demotion,
        an unknown value raises ValueError naming the class."""
        through: set[str] = set()
        others: set[str] = set()
        default = False
        for item in classes:
            if not isinstance(item, Mapping):
                raise ValueError(f"a priority class must be an object, got {type(item).__name__}")
            name = str(item.get("name", ""))
            mode = item.get("remote_write", ON_DEMOTION)
            if mode not in REMOTE_WRITES:
                raise ValueError(
                    f"remote_write: class {name!r} has {mode!r}; expected one of {', '.join(REMOTE_WRITES)}"
                )
            namespaces = item.get("namespaces", ())
            if isinstance(namespaces, str) or not isinstance(namespaces, (list, tuple)):
                raise ValueError(f"namespaces: class {name!r} needs a list of namespace names")
            (through if mode == WRITE_THROUGH else others).update(str(n) for n in namespaces)
            if name == DEFAULT_CLASS and mode == WRITE_THROUGH:
                default = True
        return cls(namespaces=frozenset(through), default=default, others=frozenset(others))

    def writes_through(self, namespace: str) -> bool:
        if namespace in self.namespaces:
            return True
        return self.default and namespace not in self.others

    @property
    def any(self) -> bool:
        return bool(self.namespaces) or self.default


class RemoteWriter:
    """Copies a write-back batch's blocks of write-through namespaces from the node's tier to L3."""

    def __init__(self, *, store: TieredStore, layout: BlockLayout, counters: Counters) -> None:
        self.store = store
        self.layout = layout
        self.counters = counters
        self.policy = RemoteWritePolicy()
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._pending: set[Future[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-write-through")

    def set_classes(self, classes: Sequence[Mapping[str, object]]) -> None:
        """Take the remote writes of the classes in force (raises ValueError on a bad payload,
        keeping the previous policy)."""
        self.policy = RemoteWritePolicy.from_classes(classes)

    def submit(
        self, registrations: Sequence[BlockRegistration], then: Callable[[list[BlockRegistration]], None]
    ) -> Future[None] | None:
        """Copy the write-through blocks of `registrations` to L3 in the background (off the
        engine's turn: a write-back holds it, and an L3 write there would delay the next request's
        prefill) and hand the remote registrations to `then` (the directory's batch). The future
        of the copy, which the request waits for before it answers (`wait`); None when nothing of
        the batch writes through."""
        policy = self.policy
        if not policy.any or REMOTE not in self.store.names:
            return None
        batch = [r for r in registrations if r.tier != REMOTE and policy.writes_through(r.namespace)]
        if not batch:
            return None

        def run() -> None:
            written = self.copy(batch)
            if written:
                then(written)

        future = self._executor.submit(run)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def wait(self, futures: Sequence[Future[None]], timeout: float) -> bool:
        """Wait for a request's copies to L3 (write-through: the next turn, on any node, finds
        them); False, counted and logged, if `timeout` passed first (the copies go on)."""
        if not futures:
            return True
        _, not_done = wait(futures, timeout=timeout)
        if not_done:
            self.counters.add("write_through.late")
            log.warning("write-through to L3 still running after %.1f s; answering without waiting", timeout)
        return not not_done

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)
        if not future.cancelled() and (exc := future.exception()) is not None:
            self.counters.add("write_through.failed")
            log.warning("write-through batch failed (the local copies are kept): %s", exc)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the write-throughs submitted so far; False if `timeout` passed first."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = wait(pending, timeout=timeout)
        return not not_done

    def copy(self, registrations: Sequence[BlockRegistration]) -> list[BlockRegistration]:
        """Write the write-through blocks of `registrations` to L3 as well; the registrations of
        the remote copies that were written (the local ones are the caller's, kept either way)."""
        policy = self.policy
        if not policy.any or REMOTE not in self.store.names:
            return []
        chosen = [r for r in registrations if r.tier != REMOTE and policy.writes_through(r.namespace)]
        if not chosen:
            return []
        remote = self.store.tier(REMOTE)
        written: list[BlockRegistration] = []
        with self._copy_lock:  # one host buffer, reused batch after batch
            if self._buffer is None:
                self._buffer = self.layout.empty()
            buffer = self._buffer
            for registration in chosen:
                key = registration.prefix_key
                try:
                    read = self.store.tier(registration.tier).get(key, buffer)
                    result = remote.put(key, buffer, checksum=read.checksum)
                except TierFull as exc:
                    self.counters.add("write_through.full")
                    log.warning("write-through to L3 skipped (the local copy is kept): %s", exc)
                    continue
                except WRITE_ERRORS as exc:
                    self.counters.add("write_through.failed")
                    log.warning("write-through to L3 failed (the local copy is kept): %s", exc)
                    continue
                self.counters.add("write_through.blocks")
                written.append(
                    dataclasses.replace(
                        registration,
                        tier=REMOTE,
                        node=None,
                        checksum=result.checksum.hex if result.checksum else registration.checksum,
                        locator="",
                        offset=0,
                    )
                )
        return written
