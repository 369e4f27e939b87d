"""The connector's worker half on CPU tensors laid out as vLLM's pages, with a real host tier: loads
scattered layer by layer, both save paths (straight into the pool's slot after the step; layer by
layer as the GPU path runs it, here with synchronous copies) storing the same bytes, and failures
reported as pages to recompute."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.connectors.conftest import local_runtime
from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.vllm.metadata import LoadSpec, SaveSpec, StrataMetadata
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.worker_half import WorkerHalf
from worker.dataplane.directory import PlacementChange
from worker.dataplane.layer_loader.loader import staged_hits
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload_records import Hit

PROFILE = ModelProfile(model_id="pages", layers=3, kv_heads=2, head_dim=8, dtype="float32", block_tokens=32)
LAYOUT = block_layout(PROFILE)
PAGE = 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.layers)]


@pytest.fixture
def runtime(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages") as runtime:
        yield runtime


def engine_pages(pages: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(pages, LAYOUT.kv_heads, PAGE, 2 * LAYOUT.head_dim, generator=generator) for name in NAMES}


def worker_for(runtime: Runtime, kv: dict[str, torch.Tensor], **options) -> WorkerHalf:
    """A worker half on `kv` as vLLM registers it (CPU_ATTN pages)."""
    half = WorkerHalf(runtime, **options)
    half.register(kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]))
    return half


def saving(request_id: str, keys: list[uuid.UUID], *, pages: list[int]) -> StrataMetadata:
    """A step that saves `keys` as blocks 0, 1, ... of one request on `pages`."""
    blocks = [(index, key, uuid.uuid4()) for index, key in enumerate(keys)]
    return StrataMetadata(saves=[SaveSpec(request_id=request_id, namespace="default", pages=pages, blocks=blocks)])


def run_step(half: WorkerHalf, meta: StrataMetadata) -> None:
    """One engine step as vLLM drives the worker half: bind, load, every layer, save."""
    half.bind(meta)
    half.start_loads()
    for name in NAMES:
        half.wait_layer(name)
        half.save_layer(name)
    half.finish_step()
    assert half.flush_saves(timeout=30)


@pytest.mark.parametrize("layerwise", [False, True])
def test_saved_blocks_hold_the_pages_bytes(runtime, layerwise):
    kv = engine_pages()
    half = worker_for(runtime, kv, layerwise_saves=layerwise)
    pages = [3, 4, 5, 6, 10, 11, 12, 13, 20]  # two blocks of four pages, and a partial one
    keys = [uuid.uuid4(), uuid.uuid4()]
    run_step(
        half,
        StrataMetadata(
            saves=[
                SaveSpec(
                    request_id="r",
                    namespace="default",
                    pages=pages,
                    blocks=[(0, keys[0], uuid.uuid4()), (1, keys[1], uuid.uuid4())],
                )
            ]
        ),
    )
    assert half.take_report().saved == {"r": 2}
    expected = PagedKV(list(kv.values()), kind="cpu-vec", layout=LAYOUT)
    for index, key in enumerate(keys):
        want, got = LAYOUT.empty(), LAYOUT.empty()
        expected.gather(want, index=index, pages=pages)
        runtime.store.get(key, out=got, tiers=["host"])
        assert torch.equal(got, want)


def test_a_layerwise_save_missing_a_layer_is_not_stored(runtime):
    half = worker_for(runtime, engine_pages(), layerwise_saves=True)
    key = uuid.uuid4()
    half.bind(
        StrataMetadata(
            saves=[SaveSpec(request_id="r", namespace="default", pages=list(range(4)), blocks=[(0, key, uuid.uuid4())])]
        )
    )
    for name in NAMES[:-1]:
        half.save_layer(name)
    half.finish_step()
    assert half.flush_saves(timeout=30)
    assert not runtime.store.tier("host").contains(key)
    assert runtime.manager.counters.get("write_back.incomplete") == 1


def test_a_step_whose_layers_were_never_handed_over_counts_its_blocks(runtime, caplog):
    """A step replayed as a full CUDA graph runs no layer hook: its blocks are counted, not lost silently."""
    half = worker_for(runtime, engine_pages(), layerwise_saves=True)
    keys = [uuid.uuid4(), uuid.uuid4()]
    for _ in range(2):
        half.bind(saving("r", keys, pages=list(range(8))))
        half.finish_step()
    assert half.flush_saves(timeout=30)
    assert not any(runtime.store.tier("host").contains(key) for key in keys)
    assert runtime.manager.counters.get("write_back.incomplete") == 4
    assert sum("no layer was handed over" in record.message for record in caplog.records) == 1


def test_vllm_runs_the_connector_under_piecewise_cuda_graphs():
    """What vLLM asks of a connector class before it picks full or piecewise CUDA graphs."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = KVTransferConfig(
        kv_connector="StrataConnector", kv_connector_module_path="worker.vllm_connector", kv_role="kv_both"
    )
    connector = KVConnectorFactory.get_connector_class(transfer)
    assert connector.requires_piecewise_for_cudagraph(transfer.kv_connector_extra_config) is True


def test_loads_scatter_every_layer_and_report_the_stalls(runtime):
    source = engine_pages(seed=1)
    writer = worker_for(runtime, source)
    keys = [uuid.uuid4(), uuid.uuid4()]
    run_step(
        writer,
        saving("w", keys, pages=list(range(8))),
    )
    target = engine_pages(seed=2)
    reader = worker_for(runtime, target)
    pages = [30, 31, 12, 13, 14, 15, 16, 17]
    # Tokens 8..60 (the engine's own cache held the first page; the last prompt token is computed).
    run_step(
        reader,
        StrataMetadata(
            loads=[
                LoadSpec(
                    request_id="q",
                    namespace="default",
                    keys=keys,
                    tiers=["host", "host"],
                    checksums=["", ""],
                    first_block=0,
                    start=8,
                    end=61,
                    pages=pages,
                )
            ]
        ),
    )
    report = reader.take_report()
    assert report.loads["q"].failure == "" and len(report.loads["q"].stalls) == LAYOUT.layers
    assert reader.take_invalid() == set()
    got = PagedKV(list(target.values()), kind="cpu-vec", layout=LAYOUT)
    want = PagedKV(list(source.values()), kind="cpu-vec", layout=LAYOUT)
    for layer in range(LAYOUT.layers):
        for token in (8, 31, 32, 60):
            page_got, page_want = pages[token // PAGE], token // PAGE
            assert torch.equal(got.k[layer][page_got, token % PAGE], want.k[layer][page_want, token % PAGE])
            assert torch.equal(got.v[layer][page_got, token % PAGE], want.v[layer][page_want, token % PAGE])
    untouched = PagedKV(list(engine_pages(seed=2).values()), kind="cpu-vec", layout=LAYOUT)
    assert torch.equal(got.k[0][30], untouched.k[0][30])  # the engine's own page
    assert torch.equal(got.k[0][17, 5:], untouched.k[0][17, 5:])  # token 61 on: computed by the engine
    assert torch.equal(got.v[0][17, 5:], untouched.v[0][17, 5:])


def test_a_vanished_block_reports_every_page_of_the_load(runtime):
    reader = worker_for(runtime, engine_pages())
    pages = [5, 6, 7, 8, 9, 10, 11, 12]
    run_step(
        reader,
        StrataMetadata(
            loads=[
                LoadSpec(
                    request_id="q",
                    namespace="default",
                    keys=[uuid.uuid4(), uuid.uuid4()],
                    tiers=["host", "host"],
                    checksums=["", ""],
                    first_block=0,
                    start=0,
                    end=64,
                    pages=pages,
                )
            ]
        ),
    )
    assert reader.take_invalid() == set(pages)
    assert reader.take_report().loads["q"].failure
    assert runtime.manager.counters.get("load_failures") == 1


def test_a_refused_load_reads_nothing_and_reports_its_pages(runtime):
    kv = engine_pages()
    before = {name: tensor.clone() for name, tensor in kv.items()}
    reader = worker_for(runtime, kv)
    pages = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    refused = LoadSpec(
        request_id="q",
        namespace="default",
        keys=[],
        tiers=[],
        checksums=[],
        first_block=1,
        start=40,
        end=64,
        pages=pages,
        refused="the step could not be planned",
    )
    run_step(reader, StrataMetadata(loads=[refused]))
    assert reader.take_invalid() == {10, 11, 12}  # the pages of tokens 40..63 (8 a page)
    assert reader.take_report().loads["q"].failure == "the step could not be planned"
    assert runtime.manager.counters.get("load_failures") == 1
    assert all(torch.equal(kv[name], before[name]) for name in kv)


class _Quarantines:
    """The one thing a load asks of a directory: marking a copy corrupt."""

    def __init__(self) -> None:
        self.changes: list[PlacementChange] = []

    def change_placements(self, *, changes) -> None:
        self.changes.extend(changes)


def test_a_block_read_from_l3_must_carry_the_checksum_the_scheduler_sent(tmp_path: Path, shm_name: str):
    """A block in L3 (here a shared mount) rewritten under its key with a header that is right for
    its new bytes: the load names the registered checksum (`LoadSpec.checksums`), so that block's
    pages are recomputed, its copy quarantined and counted; with the right copy the load is exact."""
    with local_runtime(
        tmp_path, shm_name, PROFILE, "pages", tiers="host,disk,remote", remote_url=str(tmp_path / "l3")
    ) as runtime:
        directory = _Quarantines()
        runtime.manager.directory = directory  # type: ignore[assignment]
        assert runtime.manager.verifies_remote
        remote = runtime.store.tier("remote")
        source = engine_pages(seed=3)
        want = PagedKV(list(source.values()), kind="cpu-vec", layout=LAYOUT)
        keys, sums = [uuid.uuid4(), uuid.uuid4()], []
        for index, key in enumerate(keys):
            block = LAYOUT.empty()
            want.gather(block, index=index, pages=list(range(8)))
            sums.append(remote.put(key, block).checksum.hex)
        pages = list(range(8, 16))

        target = engine_pages(seed=4)

        def load(checksums: list[str]) -> WorkerHalf:
            reader = worker_for(runtime, target)
            spec = LoadSpec(
                request_id="q",
                namespace="default",
                keys=keys,
                tiers=["remote", "remote"],
                checksums=checksums,
                first_block=0,
                start=0,
                end=63,
                pages=pages,
            )
            run_step(reader, StrataMetadata(loads=[spec]))
            return reader

        genuine = load(sums)
        assert genuine.take_invalid() == set() and genuine.take_report().loads["q"].failure == ""
        got = PagedKV(list(target.values()), kind="cpu-vec", layout=LAYOUT)
        for layer in range(LAYOUT.layers):
            for token in (0, 33, 62):
                page_got, page_want = pages[token // PAGE], token // PAGE
                assert torch.equal(got.k[layer][page_got, token % PAGE], want.k[layer][page_want, token % PAGE])
                assert torch.equal(got.v[layer][page_got, token % PAGE], want.v[layer][page_want, token % PAGE])

        other = LAYOUT.empty()
        want.gather(other, index=0, pages=list(range(8)))
        remote.put(keys[1], other)  # block 1 rewritten with block 0's bytes, a valid value for them
        forged = load(sums)
        assert forged.take_invalid() == set(pages) and forged.take_report().loads["q"].failure
        assert runtime.manager.counters.get("load_failures") == 1
        assert runtime.manager.counters.get("remote_unverified") == 1 and not remote.contains(keys[1])
        assert [(c.prefix_key, c.tier, c.node, c.action) for c in directory.changes] == [
            (keys[1], "remote", None, "corrupt")
        ]


def test_a_load_that_cannot_be_settled_reports_its_pages(runtime, monkeypatch):
    kv = engine_pages()
    writer = worker_for(runtime, kv)
    pages = [3, 4, 5, 6, 10, 11, 12, 13]
    keys = [uuid.uuid4(), uuid.uuid4()]
    blocks = [(0, keys[0], uuid.uuid4()), (1, keys[1], uuid.uuid4())]
    run_step(writer, StrataMetadata(saves=[SaveSpec(request_id="w", namespace="default", pages=pages, blocks=blocks)]))
    reader = worker_for(runtime, engine_pages(seed=1))

    def broken(*args, **kwargs) -> None:  # noqa: ANN002, ANN003 - a bug while the step's loads are settled
        raise RuntimeError("the loader's thread could not be joined")

    monkeypatch.setattr(reader, "_settle", broken)
    spec = LoadSpec(
        request_id="q",
        namespace="default",
        keys=keys,
        tiers=["host", "host"],
        checksums=["", ""],
        first_block=0,
        start=0,
        end=64,
        pages=[20, 21, 22, 23, 24, 25, 26, 27],
    )
    run_step(reader, StrataMetadata(loads=[spec]))
    assert reader.take_invalid() == set(spec.pages)
    assert reader.take_report().loads["q"].failure == "the loader's thread could not be joined"
    assert reader.loads == []


class _Tier:
    def __init__(self, direct: bool) -> None:
        self.reads_into_device = direct


class _Store:
    def __init__(self, **direct: bool) -> None:
        self.tiers = {name: _Tier(value) for name, value in direct.items()}

    def tier(self, name: str) -> _Tier:
        return self.tiers[name]


def test_a_gpu_load_stages_only_what_cannot_read_into_device_memory():
    hits = [
        Hit(0, uuid.uuid4(), "host"),
        Hit(1, uuid.uuid4(), "disk"),
        Hit(2, uuid.uuid4(), "remote"),
        Hit(3, uuid.uuid4(), "device"),
    ]
    # The disk with GPUDirect Storage reads into the GPU; host and remote land in host memory.
    assert staged_hits(_Store(host=False, disk=True, remote=False, device=True), hits) == [0, 2]
    assert staged_hits(_Store(host=False, disk=False, remote=False, device=True), hits) == [0, 1, 2]


@pytest.mark.parametrize(
    ("budget", "per_slot", "slots"),
    [
        (64 << 20, 3, 3),  # every layer of the load read ahead, one slot per layer (as without a budget)
        (2 * LAYOUT.layer_bytes, 1, 2),  # one block of one layer per slot, two slots
        (LAYOUT.layer_bytes, 1, 1),  # the least budget: one slot, every piece in turn
    ],
)
def test_a_load_larger_than_the_staging_budget_goes_in_pieces(tmp_path: Path, shm_name: str, budget, per_slot, slots):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", load_staging_bytes=str(budget)) as runtime:
        source = engine_pages(seed=1)
        keys = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
        run_step(worker_for(runtime, source), saving("w", keys, pages=list(range(12))))
        target = engine_pages(seed=2)
        reader = worker_for(runtime, target)
        pages = [20, 21, 22, 23, 12, 13, 14, 15, 4, 5, 6, 7]
        spec = LoadSpec("q", "default", keys, ["host"] * 3, [""] * 3, first_block=0, start=8, end=96, pages=pages)
        reader.bind(StrataMetadata(loads=[spec]))
        reader.start_loads()
        staged = reader.staged
        assert staged is not None
        assert (staged.per_slot, len(staged.ring)) == (per_slot, slots)
        assert staged.staged_bytes <= budget
        for name in NAMES:
            reader.wait_layer(name)
        reader.finish_step()
        assert reader.take_invalid() == set()
        assert reader.take_report().loads["q"].failure == ""
        got = PagedKV(list(target.values()), kind="cpu-vec", layout=LAYOUT)
        want = PagedKV(list(source.values()), kind="cpu-vec", layout=LAYOUT)
        for layer in range(LAYOUT.layers):
            assert torch.equal(got.k[layer][pages[1:]], want.k[layer][1:12])
            assert torch.equal(got.v[layer][pages[1:]], want.v[layer][1:12])
        assert torch.equal(
            got.k[0][20], PagedKV(list(engine_pages(seed=2).values()), kind="cpu-vec", layout=LAYOUT).k[0][20]
        )


def test_a_staging_budget_below_one_layer_of_a_block_is_refused(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", load_staging_bytes=str(LAYOUT.layer_bytes - 1)) as runtime:
        with pytest.raises(
            ValueError, match=rf"load_staging_bytes: .* one layer of one block \({LAYOUT.layer_bytes} bytes\)"
        ):
            WorkerHalf(runtime)


def stalled(runtime: Runtime, monkeypatch) -> threading.Event:  # noqa: ANN001
    """The store's layer reads wait until the returned event is set (a stalled tier)."""
    answer = threading.Event()
    read = runtime.store.get_layers

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        answer.wait(30)
        return read(*args, **kwargs)

    monkeypatch.setattr(runtime.store, "get_layers", slow)
    return answer


def ended(half: WorkerHalf, request_id: str, timeout: float = 30.0) -> float:
    """Poll the half as vLLM does each step until the request's load ended; seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if request_id in half.take_finished():
            return time.monotonic() - started
        time.sleep(0.01)
    raise AssertionError(f"the load of {request_id} never ended")


def stored(runtime: Runtime, source: dict[str, torch.Tensor], count: int) -> list[uuid.UUID]:
    keys = [uuid.uuid4() for _ in range(count)]
    run_step(worker_for(runtime, source), saving("w", keys, pages=list(range(4 * count))))
    return keys


def test_an_asynchronous_load_fills_the_pages_beside_the_steps(runtime):
    source = engine_pages(seed=1)
    keys = stored(runtime, source, 2)
    target = engine_pages(seed=2)
    reader = worker_for(runtime, target)
    pages = [20, 21, 22, 23, 12, 13, 14, 15]
    spec = LoadSpec("q", "default", keys, ["host"] * 2, [""] * 2, 0, 0, 64, pages, asynchronous=True)
    run_step(reader, StrataMetadata(loads=[spec]))  # the step it was handed over in does not wait for it
    ended(reader, "q")
    assert reader.take_invalid() == set()
    assert reader.take_report().loads["q"].failure == ""
    got = PagedKV(list(target.values()), kind="cpu-vec", layout=LAYOUT)
    want = PagedKV(list(source.values()), kind="cpu-vec", layout=LAYOUT)
    for layer in range(LAYOUT.layers):
        assert torch.equal(got.k[layer][pages], want.k[layer][:8])
        assert torch.equal(got.v[layer][pages], want.v[layer][:8])
    assert runtime.manager.counters.get("hit_tokens") == 64


def test_an_asynchronous_load_past_its_deadline_is_given_up_and_writes_nothing_after(
    tmp_path: Path, shm_name: str, monkeypatch
):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", load_deadline_seconds="0.3") as runtime:
        keys = stored(runtime, engine_pages(seed=1), 2)
        target = engine_pages(seed=2)
        reader = worker_for(runtime, target)
        answer = stalled(runtime, monkeypatch)
        pages = [20, 21, 22, 23, 12, 13, 14, 15]
        spec = LoadSpec("q", "default", keys, ["disk"] * 2, [""] * 2, 0, 0, 64, pages, asynchronous=True)
        run_step(reader, StrataMetadata(loads=[spec]))
        took = ended(reader, "q")
        assert 0.2 < took < 10
        assert reader.take_invalid() == set(pages)
        assert "load_deadline_seconds (0.3 s)" in reader.take_report().loads["q"].failure
        assert runtime.manager.counters.get("load_deadlines") == 1
        answer.set()  # the tier answers after all: its bytes must not reach pages vLLM has handed on
        time.sleep(0.5)
        untouched = engine_pages(seed=2)
        for name in NAMES:
            assert torch.equal(target[name], untouched[name])
        assert all(runtime.store.tier("host").contains(key) for key in keys)  # slow, not corrupt: kept


def test_a_layer_wait_past_the_deadline_recomputes_the_load(tmp_path: Path, shm_name: str, monkeypatch):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", load_deadline_seconds="0.3") as runtime:
        keys = stored(runtime, engine_pages(seed=1), 2)
        reader = worker_for(runtime, engine_pages(seed=2))
        answer = stalled(runtime, monkeypatch)
        pages = [20, 21, 22, 23, 12, 13, 14, 15]
        spec = LoadSpec("q", "default", keys, ["host"] * 2, [""] * 2, 0, 0, 64, pages)
        started = time.monotonic()
        run_step(reader, StrataMetadata(loads=[spec]))
        assert time.monotonic() - started < 10
        assert reader.take_invalid() == set(pages)
        assert runtime.manager.counters.get("load_deadlines") == 1
        answer.set()
        time.sleep(0.5)  # the stalled read lands before the tiers close


def held_puts(monkeypatch, runtime: Runtime) -> tuple[threading.Event, threading.Event]:
    """Hold the host tier's `put` (the save queue's store) until the returned gate is set; the
    other event is set once a put is waiting."""
    host = runtime.store.tier("host")
    gate, entered = threading.Event(), threading.Event()
    put = host.put

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return put(*args, **kwargs)

    monkeypatch.setattr(host, "put", held)
    return gate, entered


def test_saved_blocks_are_stored_outside_the_step_from_the_copy_taken_in_it(runtime, monkeypatch):
    host = runtime.store.tier("host")
    gate, entered = held_puts(monkeypatch, runtime)
    kv = engine_pages()
    want = PagedKV([page.clone() for page in kv.values()], kind="cpu-vec", layout=LAYOUT)
    half = worker_for(runtime, kv)
    keys = [uuid.uuid4(), uuid.uuid4()]
    half.bind(saving("r", keys, pages=list(range(8))))
    half.finish_step()  # returns while the store is held
    assert entered.wait(30)
    assert not any(host.contains(key) for key in keys)
    for page in kv.values():  # the pages go to another request once the step is over
        page.normal_()
    gate.set()
    assert half.flush_saves(timeout=30)
    assert half.take_report().saved == {"r": 2}
    for index, key in enumerate(keys):
        expected, got = LAYOUT.empty(), LAYOUT.empty()
        want.gather(expected, index=index, pages=list(range(8)))
        runtime.store.get(key, out=got, tiers=["host"])
        assert torch.equal(got, expected)
    assert runtime.manager.counters.get("write_back.inline") == 0


def test_blocks_past_the_save_budget_are_stored_inside_the_step(tmp_path: Path, shm_name: str, monkeypatch):
    overrides = {"save_staging_bytes": str(LAYOUT.block_bytes)}  # room for one block's copy
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", **overrides) as runtime:
        host = runtime.store.tier("host")
        gate, entered = held_puts(monkeypatch, runtime)
        half = worker_for(runtime, engine_pages())
        keys = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
        half.bind(saving("r", keys, pages=list(range(12))))
        half.finish_step()
        assert entered.wait(30)
        assert [host.contains(key) for key in keys] == [False, True, True]
        assert runtime.manager.counters.get("write_back.inline") == 2
        gate.set()
        assert half.flush_saves(timeout=30)
        assert all(host.contains(key) for key in keys)
        assert half.take_report().saved == {"r": 3}
        half.close()


def test_a_save_budget_of_nothing_stores_every_block_inside_the_step(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "pages", save_staging_bytes="0") as runtime:
        half = worker_for(runtime, engine_pages())
        keys = [uuid.uuid4(), uuid.uuid4()]
        half.bind(saving("r", keys, pages=list(range(8))))
        half.finish_step()
        assert all(runtime.store.tier("host").contains(key) for key in keys)
        assert half.saves.queue.pending == 0
        assert runtime.manager.counters.get("write_back.inline") == 2


def test_closing_the_worker_stores_what_its_save_queue_holds(runtime, monkeypatch):
    gate, entered = held_puts(monkeypatch, runtime)
    half = worker_for(runtime, engine_pages())
    keys = [uuid.uuid4()]
    half.bind(saving("r", keys, pages=list(range(4))))
    half.finish_step()
    assert entered.wait(30)
    threading.Timer(0.1, gate.set).start()
    half.close(timeout=30)
    assert runtime.store.tier("host").contains(keys[0])
