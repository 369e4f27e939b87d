"""What a failed load leaves behind, on the worker half with a real host tier and CPU pages laid out
as vLLM's: no block computed over a page it failed to fill is stored, in its own step or in a step
planned before the scheduler half read its report; an error part-way through a step's loads
reports every page it promised and ends every asynchronous load; a request that ends while its
load runs has the load given up, so vLLM frees its pages; and the registered pages must be the
size vLLM's scheduler counts them in."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from tests.connectors.conftest import local_runtime
from tests.connectors.test_worker_half import LAYOUT, NAMES, PAGE, PROFILE, engine_pages, worker_for
from tests.connectors.test_worker_half import run_step as step
from worker.dataplane.connectors.vllm.failed_pages import FailedPages
from worker.dataplane.connectors.vllm.metadata import LoadSpec, SaveSpec, StrataMetadata
from worker.dataplane.connectors.vllm.worker_half import WorkerHalf

PER_BLOCK = LAYOUT.block_tokens // PAGE


@pytest.fixture
def runtime(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages") as runtime:
        yield runtime


def held(runtime, key: uuid.UUID) -> bool:
    return bool(runtime.store.tier("host").contains(key))


def stored_blocks(runtime, count: int) -> list[uuid.UUID]:
    """`count` blocks put in the host tier (what earlier requests saved)."""
    keys = [uuid.uuid4() for _ in range(count)]
    for key in keys:
        runtime.store.put(key, LAYOUT.empty(), tier="host")
    return keys


def load(request_id: str, keys: list[uuid.UUID], pages: list[int], *, end: int, **extra) -> LoadSpec:
    return LoadSpec(
        request_id=request_id,
        namespace="default",
        keys=keys,
        tiers=["host"] * len(keys),
        checksums=[""] * len(keys),
        first_block=0,
        start=0,
        end=end,
        pages=pages,
        **extra,
    )


def save(request_id: str, pages: list[int], *blocks: int) -> tuple[SaveSpec, dict[int, uuid.UUID]]:
    keys = {index: uuid.uuid4() for index in blocks}
    spec = SaveSpec(
        request_id=request_id,
        namespace="default",
        pages=pages,
        blocks=[(index, key, uuid.uuid4()) for index, key in keys.items()],
    )
    return spec, keys


def test_failed_pages_poison_the_blocks_whose_prefix_holds_them_until_a_later_plan():
    failed = FailedPages(pages_per_block=4)
    table = list(range(100, 112))  # three blocks of four pages
    failed.failed(3, [104, 105])  # block 1's first pages
    assert not failed.poisons(table, 0)  # block 0 attends to pages 100-103 only
    assert failed.poisons(table, 1) and failed.poisons(table, 2)
    assert not failed.poisons(list(range(200, 212)), 2)  # another request's pages
    failed.acknowledged(2)  # a plan made before step 3's report was read
    assert failed.poisons(table, 2)
    failed.acknowledged(3)
    assert not failed and not failed.poisons(table, 2)


def test_a_block_computed_in_the_step_whose_load_failed_is_not_stored(runtime):
    """The issue's case: blocks 0-1 of a request are planned as hits, block 1 has left the tier by
    the time the worker reads it; the step computes block 2 over pages holding someone else's KV.
    Block 2 is not stored (its key would otherwise hold poisoned bytes for good); another request's
    block saved in the same step is."""
    half = worker_for(runtime, engine_pages())
    present = stored_blocks(runtime, 1)
    pages = list(range(12))  # blocks 0, 1, 2
    spec = load("q", [present[0], uuid.uuid4()], pages, end=2 * LAYOUT.block_tokens)
    poisoned, poisoned_keys = save("q", pages, 2)
    clean, clean_keys = save("other", list(range(20, 24)), 0)
    step(half, StrataMetadata(loads=[spec], saves=[poisoned, clean], step=1, reported=0))
    assert half.take_invalid() == set(pages[: 2 * PER_BLOCK])
    assert not held(runtime, poisoned_keys[2])
    assert held(runtime, clean_keys[0])
    assert runtime.manager.counters.get("write_back.poisoned") == 1
    assert half.take_report().saved == {"other": 1}


def test_steps_planned_before_the_failure_was_reported_store_nothing_over_its_pages(runtime):
    """Asynchronous scheduling plans step 2 before step 1's report is read: step 2's blocks of the
    failing request are not stored; step 3, planned after, stores its recomputed block."""
    half = worker_for(runtime, engine_pages())
    pages = list(range(12))
    spec = load("q", [uuid.uuid4()], pages, end=LAYOUT.block_tokens)  # block 0 vanished
    step(half, StrataMetadata(loads=[spec], step=1, reported=0))
    assert half.take_invalid() == set(pages[:PER_BLOCK])
    early, early_keys = save("q", pages, 1)
    step(half, StrataMetadata(saves=[early], step=2, reported=0))
    assert not held(runtime, early_keys[1])
    later, later_keys = save("q", pages, 0, 1)
    step(half, StrataMetadata(saves=[later], step=3, reported=1))
    assert held(runtime, later_keys[0]) and held(runtime, later_keys[1])
    assert runtime.manager.counters.get("write_back.poisoned") == 1


@pytest.mark.parametrize("layerwise", [False, True])
def test_both_save_paths_drop_a_poisoned_block(runtime, layerwise):
    half = worker_for(runtime, engine_pages(), layerwise_saves=layerwise)
    pages = list(range(8))
    spec = load("q", [uuid.uuid4()], pages, end=LAYOUT.block_tokens)
    poisoned, keys = save("q", pages, 1)
    step(half, StrataMetadata(loads=[spec], saves=[poisoned], step=1))
    assert not held(runtime, keys[1])
    assert runtime.manager.counters.get("write_back.poisoned") == 1


def test_an_error_part_way_through_starting_the_loads_reports_every_load_of_the_step(runtime, monkeypatch):
    """An asynchronous load that cannot start, between others: the synchronous loads before and
    after it have their pages reported, the asynchronous one started before it is given up, and
    every asynchronous load of the step is reported finished, so no request waits forever."""
    half = worker_for(runtime, engine_pages())
    keys = stored_blocks(runtime, 1)
    first = load("async-started", keys, [0, 1, 2, 3], end=LAYOUT.block_tokens, asynchronous=True)
    sync_a = load("sync-a", keys, [4, 5, 6, 7], end=LAYOUT.block_tokens)
    failing = load("async-failing", keys, [8, 9, 10, 11], end=LAYOUT.block_tokens, asynchronous=True)
    sync_b = load("sync-b", keys, [12, 13, 14, 15], end=LAYOUT.block_tokens)
    started = threading.Event()
    real_start = half.async_loads.start

    def start(spec, paged):  # noqa: ANN001
        if spec.request_id == "async-failing":
            raise RuntimeError("no thread could be started")
        real_start(spec, paged)
        started.set()

    release = threading.Event()
    real_read = runtime.store.get_layers

    def slow_read(*args, **kwargs):  # noqa: ANN002, ANN003 - the started load's read is still under way
        release.wait(10)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(half.async_loads, "start", start)
    monkeypatch.setattr(runtime.store, "get_layers", slow_read)
    step(half, StrataMetadata(loads=[first, sync_a, failing, sync_b], step=1))
    assert started.is_set()
    ended = half.take_finished()
    release.set()
    assert ended == {"async-started", "async-failing"}
    assert half.take_invalid() == set(range(16))
    report = half.take_report()
    assert all("no thread could be started" in report.loads[r].failure for r in ("sync-a", "async-failing", "sync-b"))
    assert report.loads["async-started"].failure
    assert half.async_loads.running == {}


def test_an_error_settling_the_step_s_loads_reports_their_pages(runtime, monkeypatch):
    half = worker_for(runtime, engine_pages())
    keys = stored_blocks(runtime, 1)
    spec = load("q", keys, [4, 5, 6, 7], end=LAYOUT.block_tokens)
    saved, saved_keys = save("q", [4, 5, 6, 7, 8, 9, 10, 11], 1)

    def join(timeout=None) -> bool:  # noqa: ANN001 - the loader's thread cannot be joined
        raise RuntimeError("the loader's thread could not be joined")

    half.bind(StrataMetadata(loads=[spec], saves=[saved], step=1))
    half.start_loads()
    assert half.staged is not None
    monkeypatch.setattr(half.staged, "join", join)
    for name in NAMES:
        half.wait_layer(name)
    half.finish_step()
    assert half.flush_saves(timeout=30)
    assert half.take_invalid() == {4, 5, 6, 7}
    assert not held(runtime, saved_keys[1])  # computed over pages not known to be whole


def test_a_request_that_ends_while_its_load_runs_has_the_load_given_up(runtime, monkeypatch):
    """vLLM keeps the pages of a request that ended while its asynchronous load runs until the
    worker reports the load finished; the scheduler half names it in the next step, and the
    load is given up at once, however slow its tier, its pages written no more."""
    kv = engine_pages()
    half = worker_for(runtime, kv)
    keys = stored_blocks(runtime, 1)
    release = threading.Event()
    real_read = runtime.store.get_layers

    def stuck(*args, **kwargs):  # noqa: ANN002, ANN003
        futures: list[Future] = []
        for _ in args[0]:
            future: Future = Future()
            futures.append(future)

        def later() -> None:
            release.wait(30)
            for future, answer in zip(futures, real_read(*args, **kwargs), strict=True):
                future.set_result(answer.result())

        threading.Thread(target=later, daemon=True).start()
        return futures

    monkeypatch.setattr(runtime.store, "get_layers", stuck)
    spec = load("q", keys, [0, 1, 2, 3], end=LAYOUT.block_tokens, asynchronous=True)
    step(half, StrataMetadata(loads=[spec], step=1))
    assert half.take_finished() == set()  # its tier has not answered
    before = {name: tensor.clone() for name, tensor in kv.items()}
    step(half, StrataMetadata(step=2, reported=1, aborted=["q"]))
    assert half.take_finished() == {"q"}
    assert half.take_invalid() == {0, 1, 2, 3}
    release.set()
    threading.Event().wait(0.5)  # the read lands in the load's staging memory, never in the pages
    assert all(torch.equal(kv[name], before[name]) for name in kv)
    assert half.take_report().loads["q"].failure


def test_registered_pages_of_another_size_than_vllm_s_block_size_are_refused(runtime):
    half = WorkerHalf(runtime)
    kv = engine_pages()
    with pytest.raises(ValueError, match=r"pages of 8 tokens, vLLM's block_size is 16"):
        half.register(kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]), block_size=16)
    half.register(kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]), block_size=PAGE)
