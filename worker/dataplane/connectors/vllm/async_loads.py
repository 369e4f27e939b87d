"""Loads outside vLLM's engine step: a hit from a slow tier (`async_load_tiers`) is read and
scattered into the request's pages by a thread of its own while the engine keeps computing the
other requests; vLLM holds the request back (WAITING_FOR_REMOTE_KVS) until `get_finished`
reports it.

A load has a deadline (`load_deadline_seconds`). Past it the load is given up: reported finished
with every page it was to fill invalid, so vLLM recomputes them. Its pages may go to another
request as soon as that report is out, so once given up the load writes nothing more into them:
each piece is scattered under the load's lock, after checking that it was not given up (a read
still under way lands in the load's own staging memory, never in the pages).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.staging import LoadKeys, Piece, StagedLoads
from worker.dataplane.connectors.vllm.metadata import LoadReport, LoadSpec
from worker.dataplane.connectors.vllm.sharding import Shard
from worker.dataplane.layout import BlockLayout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.prefix.cache import LoadFailed
from worker.dataplane.store import TieredStore

log = logging.getLogger("strata.vllm")


@dataclasses.dataclass
class AsyncLoad:
    """One request's load running beside the engine."""

    spec: LoadSpec
    started: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    given_up: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: LoadFailed | None = None
    staged: StagedLoads | None = None
    scattered_layers: int = 0

    def give_up(self, failure: LoadFailed) -> None:
        """Past the deadline: nothing more is written into the pages (waits for a piece being
        scattered right now)."""
        with self.lock:
            self.given_up = True
            self.failure = self.failure or failure
        if self.staged is not None:
            self.staged.stop()


def scatter_piece(
    paged: PagedKV, shard: Shard, layout: BlockLayout, spec: LoadSpec, piece: Piece, data: torch.Tensor
) -> None:
    """Write a staged piece (one layer of hit blocks [first, first + count) of `spec`) into the
    request's pages: this rank's heads, only the tokens the load covers."""
    size = layout.block_tokens
    typed = data.view(layout.dtype).view(piece.count, 2, *layout.kv_shape)
    first_block = spec.first_block + piece.first
    start = max(spec.start, first_block * size)
    end = min(spec.end, (first_block + piece.count) * size)
    if start < end:
        paged.scatter(
            shard.local(piece.layer, layout),
            shard.share(typed),
            first_block=first_block,
            start=start,
            end=end,
            pages=spec.pages,
        )


class AsyncLoads:
    """The loads running beside the engine, and the ones finished since the engine last asked."""

    def __init__(
        self,
        *,
        store: TieredStore,
        layout: BlockLayout,
        shard: Shard,
        budget: int,
        deadline_s: float,
        verify_remote: Callable[[], bool],
    ) -> None:
        self.store = store
        self.layout = layout
        self.shard = shard
        self.budget = budget
        self.deadline_s = deadline_s
        self.verify_remote = verify_remote
        self.running: dict[str, AsyncLoad] = {}

    def start(self, spec: LoadSpec, paged: PagedKV) -> None:
        load = AsyncLoad(spec, time.perf_counter())
        self.running[spec.request_id] = load
        thread = threading.Thread(target=self._run, args=(load, paged), name="strata-async-load", daemon=True)
        thread.start()

    def _run(self, load: AsyncLoad, paged: PagedKV) -> None:
        spec, layout = load.spec, self.layout
        stream: Any = torch.cuda.Stream(paged.device) if paged.device.type == "cuda" else None
        try:
            checksums = list(spec.checksums) if self.verify_remote() else None
            staged = StagedLoads(
                store=self.store,
                layout=layout,
                loads=[LoadKeys(list(spec.keys), checksums)],
                budget=self.budget,
                pin=stream is not None,
                layers=self.shard.layers(layout),
            )
            load.staged = staged
            if load.given_up:
                return
            staged.start()
            for layer in staged.layers:
                for piece in staged.layer_pieces(layer):
                    info = staged.pieces[piece]
                    data, failure = staged.take(piece)
                    try:
                        if failure is not None or data is None:
                            load.failure = load.failure or failure
                            return
                        with load.lock:
                            if load.given_up:
                                return
                            on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                            with on_stream:
                                scatter_piece(paged, self.shard, layout, spec, info, data)
                            if stream is not None:
                                stream.synchronize()  # the slot is handed back: its bytes are copied
                    finally:
                        staged.release(piece)
                load.scattered_layers += 1
        except Exception as exc:  # noqa: BLE001 - never an engine error: the pages are recomputed
            log.exception("request %s: asynchronous load failed", spec.request_id)
            load.failure = load.failure or LoadFailed(load.scattered_layers, 0, exc)
        finally:
            if load.staged is not None:
                load.staged.stop()
            load.done.set()

    def give_up(self, request_id: str, reason: str) -> bool:
        """Give up the running load of `request_id` (it ended, or its step's loads failed): it
        writes nothing more into the pages and is settled as failed by the next `settle`. False
        when no load of it runs."""
        load = self.running.get(request_id)
        if load is None:
            return False
        load.give_up(LoadFailed(load.scattered_layers, 0, RuntimeError(reason)))
        return True

    def give_up_all(
        self, manager: OffloadManager, *, invalidate: Callable[[LoadSpec], None], cause: BaseException
    ) -> list[tuple[LoadSpec, LoadReport]]:
        """After an error settling them: every running load given up, its pages invalidated, and
        reported failed, so that no request waits for its load forever."""
        ended = []
        for request_id, load in list(self.running.items()):
            del self.running[request_id]
            load.give_up(LoadFailed(load.scattered_layers, 0, cause))
            invalidate(load.spec)
            manager.counters.add("load_failures")
            ended.append((load.spec, LoadReport([], [], 0.0, [], {}, failure=f"given up: {cause}")))
        return ended

    def finished(self, now: float | None = None) -> list[AsyncLoad]:
        """The loads done or given up since the last call, and those given up now for their deadline."""
        now = time.perf_counter() if now is None else now
        ended = []
        for request_id, load in list(self.running.items()):
            if load.done.is_set() or load.given_up:
                pass  # a load given up writes nothing more into its pages: it ends now
            elif now - load.started > self.deadline_s:
                load.give_up(
                    LoadFailed(
                        load.scattered_layers,
                        0,
                        TimeoutError(f"not loaded within load_deadline_seconds ({self.deadline_s:g} s)"),
                    )
                )
            else:
                continue
            del self.running[request_id]
            ended.append(load)
        return ended

    def settle(
        self, manager: OffloadManager, *, invalidate: Callable[[LoadSpec], None]
    ) -> list[tuple[LoadSpec, LoadReport]]:
        """Each load that ended (`finished`) and its report; a load that did not complete has its
        pages invalidated (`invalidate`), is counted, and its block quarantined when it was bad
        (not when the tier was merely slow)."""
        settled = []
        for load in self.finished():
            try:
                settled.append((load.spec, self._settle(load, manager, invalidate)))
            except Exception as exc:  # noqa: BLE001 - a load not known to be whole is recomputed
                log.exception("request %s: its load could not be settled; vLLM recomputes it", load.spec.request_id)
                invalidate(load.spec)
                settled.append((load.spec, LoadReport([], [], 0.0, [], {}, failure=str(exc))))
        return settled

    def _settle(self, load: AsyncLoad, manager: OffloadManager, invalidate: Callable[[LoadSpec], None]) -> LoadReport:
        spec, staged = load.spec, load.staged
        if load.failure is None and load.scattered_layers < len(self.shard.layers(self.layout)):
            load.failure = LoadFailed(load.scattered_layers, 0, RuntimeError("the load ended early"))
        failure = load.failure
        started = staged.started_at if staged is not None else load.started
        blocks = collections.Counter(spec.tiers)
        report = LoadReport(
            stalls=[],
            loaded_at=list(staged.layer_loaded) if staged is not None else [],
            load_s=max(0.0, time.perf_counter() - started),
            tier_loads=[(tier, nbytes, staged.served_until[tier] - started) for tier, nbytes in staged.served.items()]
            if staged is not None and failure is None
            else [],
            blocks_by_tier=dict(blocks),
            failure="" if failure is None else str(failure),
        )
        if failure is None:
            tokens = spec.end - spec.start
            manager.counters.add("hit_tokens", tokens)
            manager.counters.add("reused_tokens.prefix", tokens)
            for tier, count in blocks.items():
                manager.counters.add(f"hit_blocks.{tier}", count)
            return report
        invalidate(spec)
        manager.counters.add("load_failures")
        if isinstance(failure.cause, TimeoutError):
            manager.counters.add("load_deadlines")
        elif failure.block_index < len(spec.keys):
            manager.quarantine(spec.keys[failure.block_index], failure.cause, spec.namespace)
        log.warning(
            "request %s: asynchronous load failed (%s); vLLM recomputes its %d tokens",
            spec.request_id,
            failure,
            spec.end - spec.start,
        )
        return report
