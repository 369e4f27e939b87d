"""Connectors for the fault-injection differential test (vLLM loads them by kv_connector_module_path
"tests.connectors.faults"): Strata's connector on the node's tiers alone, whose loads fail as a
request asks (its kv_transfer_params strata_test_fault names the cause), and copies of it with one
of the fixes that keep a failed load from poisoning anything turned off.

    FaultyLoads             every fix on; the load of a marked request fails by its cause, on its
                            last block:
                              evicted    the block leaves its tier between the lookup and the load
                              corrupt    a byte of the block's first layer flips in its tier
                              deadline   the tier answers the load's first read of it past
                                         load_deadline_seconds (a synchronous load misses its
                                         layer's deadline; an asynchronous one is given up)
                              exception  the worker half raises while it scatters the block's
                                         second layer into the pages
    PoisonedSavesKept       the saves of a step are not checked against the pages its loads failed
                            to fill (deliverable 1 off)
    LoadedPagesShared       the pages a synchronous load fills stay in vLLM's prefix cache
                            (deliverable 2 off)
    CheckpointKeyOnly       the model key is the checkpoint's as it is on disk, whatever vLLM runs
                            (deliverable 4 off)

Every patch is made on the connector's own objects (the engines of the test run in its process).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from worker.dataplane.connectors.vllm import StrataConnectorBase
from worker.dataplane.connectors.vllm import connector as connector_module

FAULT_PARAM = "strata_test_fault"
CAUSES = ("evicted", "corrupt", "deadline", "exception")


class FaultyLoads(StrataConnectorBase):
    """Strata's connector (the node's tiers, no directory) with every fix on, whose marked loads
    fail (the pages they were to fill holding noise). Every hit is loaded (the load-or-recompute
    decision is off: the tiers' speeds, learned from loads made slow on purpose, would otherwise
    send some hits to recompute)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with self.patched():
            super().__init__(*args, **kwargs)
        self.runtime.manager.decide_enabled = False
        if self.scheduler is not None:
            self._mark_loads(self.scheduler)
            self.turn_off_scheduler(self.scheduler)
        if self.worker is not None:
            self._fail_marked_loads(self.worker)
            self.turn_off_worker(self.worker)

    # -- what a mutant turns off -----------------------------------------------------------------
    def patched(self) -> Any:
        """A context in which the connector opens (a mutant changes a function it calls)."""
        import contextlib

        return contextlib.nullcontext()

    def turn_off_scheduler(self, half: Any) -> None:
        """Turn a fix of the scheduler half off (on this object only)."""

    def turn_off_worker(self, half: Any) -> None:
        """Turn a fix of the worker half off (on this object only)."""

    # -- the faults ------------------------------------------------------------------------------
    @staticmethod
    def _mark_loads(half: Any) -> None:
        """Each load spec carries its request's fault (an attribute the worker half's copy keeps)."""
        plan = half._load

        def load(tracked: Any, computed: int) -> Any:
            spec = plan(tracked, computed)
            params = tracked.request.kv_transfer_params or {}
            spec.fault = str(params.get(FAULT_PARAM, ""))
            return spec

        half._load = load

    def _fail_marked_loads(self, half: Any) -> None:
        store = half.manager.store
        deadline = half.runtime.config.load_deadline_seconds
        slow: set[uuid.UUID] = set()
        read = store.get_layers

        def get_layers(keys: Any, *args: Any, **kwargs: Any) -> list[Future[Any]]:
            futures = read(keys, *args, **kwargs)
            late = [i for i, key in enumerate(keys) if key in slow]
            if not late:
                return futures
            slow.difference_update(keys[i] for i in late)  # the faulted load's read only, once
            delayed = list(futures)
            for i in late:
                held: Future[Any] = Future()

                def answer(source: Future[Any] = futures[i], target: Future[Any] = held) -> None:
                    time.sleep(deadline + 1.0)  # past the load's deadline
                    error = source.exception()
                    if error is not None:
                        target.set_exception(error)
                    else:
                        target.set_result(source.result())

                threading.Thread(target=answer, daemon=True).start()
                delayed[i] = held
            return delayed

        store.get_layers = get_layers

        start = half.start_loads

        def start_loads() -> None:
            meta = half.meta
            for spec in meta.loads if meta is not None else ():
                fault = getattr(spec, "fault", "")
                if not fault or not spec.keys:
                    continue
                key, tier = spec.keys[-1], spec.tiers[-1]
                _scramble(half.paged, spec)
                if fault == "evicted":
                    store.delete(key, tier=tier)
                elif fault == "corrupt":
                    _flip_first_layer(store.tier(tier), key)
                elif fault == "deadline":
                    slow.add(key)
                elif fault == "exception":
                    _raise_on_second_layer(half, spec)
            start()

        half.start_loads = start_loads


def _scramble(paged: Any, spec: Any) -> None:
    """Noise in every page the load is to fill, in every layer: what a page a failed load leaves
    unfilled holds is another request's KV, never by chance the KV it was to receive."""
    import torch

    n = paged.page_tokens
    pages = spec.pages[spec.start // n : -(-spec.end // n)]
    generator = torch.Generator().manual_seed(len(pages))
    for k, v in zip(paged.k, paged.v, strict=True):
        for page in pages:
            k[page].copy_(torch.randn(k[page].shape, generator=generator))
            v[page].copy_(torch.randn(v[page].shape, generator=generator))


def _flip_first_layer(tier: Any, key: uuid.UUID) -> None:
    """Flip a byte of the block's first layer where the tier keeps it (a fault of the medium)."""
    if tier.name == "host":
        slot = tier._find(key)
        assert slot is not None, "the block to corrupt is in the host tier"
        tier._data[slot * tier.slot_bytes + 5] ^= 0x10
    else:
        path = tier.path_of(key)
        with open(path, "r+b") as handle:
            handle.seek(tier.header_bytes + 5)
            byte = handle.read(1)
            handle.seek(tier.header_bytes + 5)
            handle.write(bytes([byte[0] ^ 0x10]))


def _raise_on_second_layer(half: Any, spec: Any) -> None:
    """The worker half's scatter of `spec`'s pages raises from the second layer on (the first layer
    is in place: a load that failed part-way)."""
    paged = half.paged
    scatter = paged.scatter
    pages = spec.pages

    def failing(layer: int, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("pages") is pages and layer >= 1:
            raise RuntimeError("a bug in the worker half while scattering")
        scatter(layer, *args, **kwargs)

    paged.scatter = failing


class PoisonedSavesKept(FaultyLoads):
    def turn_off_worker(self, half: Any) -> None:
        half._poisoned = lambda spec, index: False


class LoadedPagesShared(FaultyLoads):
    def turn_off_scheduler(self, half: Any) -> None:
        bind = half.bind_prefix_cache

        def bind_sharing_everything(kv_cache_manager: Any) -> None:
            bind(kv_cache_manager)
            half.loaded_pages.unshare = lambda pages, first: None

        half.bind_prefix_cache = bind_sharing_everything


class CheckpointKeyOnly(FaultyLoads):
    def patched(self) -> Any:
        import contextlib

        from worker.dataplane.connectors.vllm import runtime

        @contextlib.contextmanager
        def checkpoint_only() -> Any:
            settings = runtime.runtime_settings
            runtime.runtime_settings = lambda model, on_disk: {}  # type: ignore[assignment]
            try:
                yield
            finally:
                runtime.runtime_settings = settings  # type: ignore[assignment]

        assert connector_module.profile_for is runtime.profile_for
        return checkpoint_only()
