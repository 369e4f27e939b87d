"""Tensor and pipeline parallel in the worker half, on CPU pages and a real host tier: ranks run in
threads of one process and meet in a gather as the connector's group of the model's ranks would.
Blocks saved at two ranks, or at two stages of two ranks, hold the whole model's KV (the bytes one
rank would save), and serve one, two and four ranks, and two stages."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.connectors.conftest import local_runtime
from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.connectors.vllm.metadata import LoadReport, LoadSpec, SaveSpec, StrataMetadata, StrataWorkerMeta
from worker.dataplane.connectors.vllm.runtime import Runtime
from worker.dataplane.connectors.vllm.sharding import Shard
from worker.dataplane.connectors.vllm.worker_half import WorkerHalf
from worker.dataplane.layout import ModelProfile, block_layout

PROFILE = ModelProfile(model_id="shards", layers=2, kv_heads=4, head_dim=8, dtype="float32", block_tokens=32)
LAYOUT = block_layout(PROFILE)
PAGE = 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.layers)]


@pytest.fixture
def runtime(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "shards") as runtime:
        yield runtime


def model_pages(pages: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every kv head of every layer, as one rank's CPU_ATTN pages would hold them."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(pages, LAYOUT.kv_heads, PAGE, 2 * LAYOUT.head_dim, generator=generator) for name in NAMES}


def rank_pages(kv: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """A rank's pages: its heads of its stage's layers (vLLM's CPU_ATTN tensor per rank)."""
    layers = shard.layers(LAYOUT)
    return {
        name: tensor[:, shard.first : shard.first + shard.heads].contiguous()
        for name, tensor in kv.items()
        if int(name.split(".")[2]) in layers
    }


class Group:
    """The model's ranks as threads: the gather every rank's save queue calls once per step with saves."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * ranks

    def gather_for(self, rank: int) -> Callable[[torch.Tensor], list[torch.Tensor] | None]:
        def gather(tensor: torch.Tensor) -> list[torch.Tensor] | None:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            shares = [part for part in self.parts if part is not None] if rank == 0 else None
            self.barrier.wait()
            return shares

        return gather


STAGES = ((0, 1), (1, 2))
"""Two pipeline stages of the two-layer model: a layer each."""


def halves(runtime: Runtime, kv: dict[str, torch.Tensor], ranks: int, stages: int = 1) -> list[WorkerHalf]:
    """The model's worker halves: `ranks` tensor-parallel ranks in each of `stages` stages, in the
    gather's order (the ranks of stage 0, then of stage 1)."""
    group = Group(ranks * stages)
    result = []
    for index in range(ranks * stages):
        stage, rank = divmod(index, ranks)
        shard = Shard(
            rank=rank, ranks=ranks, kv_heads=LAYOUT.kv_heads, stage=stage, stages=STAGES if stages > 1 else ()
        )
        half = WorkerHalf(runtime, shard=shard, gather=None if shard.whole else group.gather_for(index))
        own = rank_pages(kv, shard)
        half.register(own, dict.fromkeys(own, "cpu-vec"), lambda name: int(name.split(".")[2]))
        result.append(half)
    return result


def step(halves: list[WorkerHalf], meta: StrataMetadata) -> None:
    """One engine step on every rank at once, as vLLM drives them."""

    def run(half: WorkerHalf) -> None:
        half.bind(meta)
        half.start_loads()
        for name in NAMES:
            half.wait_layer(name)
            half.save_layer(name)
        half.finish_step()
        assert half.flush_saves(timeout=30)

    threads = [threading.Thread(target=run, args=(half,)) for half in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank never finished its step"


def saving(keys: list[uuid.UUID], pages: list[int]) -> StrataMetadata:
    blocks = [(index, key, uuid.uuid4()) for index, key in enumerate(keys)]
    return StrataMetadata(saves=[SaveSpec(request_id="w", namespace="default", pages=pages, blocks=blocks)])


def loading(keys: list[uuid.UUID], pages: list[int], end: int) -> StrataMetadata:
    spec = LoadSpec(
        request_id="q",
        namespace="default",
        keys=keys,
        tiers=["host"] * len(keys),
        checksums=[""] * len(keys),
        first_block=0,
        start=0,
        end=end,
        pages=pages,
    )
    return StrataMetadata(loads=[spec])


def whole_blocks(kv: dict[str, torch.Tensor], keys: list[uuid.UUID], pages: list[int]) -> list[torch.Tensor]:
    paged = PagedKV(list(kv.values()), kind="cpu-vec", layout=LAYOUT)
    blocks = []
    for index in range(len(keys)):
        block = LAYOUT.empty()
        paged.gather(block, index=index, pages=pages)
        blocks.append(block)
    return blocks


def test_shards_split_heads_and_replicate_them_past_the_model_s_count():
    assert [(s.first, s.heads) for s in (Shard(rank=r, ranks=2, kv_heads=4) for r in range(2))] == [(0, 2), (2, 2)]
    assert [Shard(rank=r, ranks=8, kv_heads=4).first for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="cannot be split evenly across 3"):
        Shard(rank=0, ranks=3, kv_heads=4)
    with pytest.raises(ValueError, match="needs the gather"):
        WorkerHalf.__new__(WorkerHalf).__init__(  # a tensor-parallel half cannot run without its group
            runtime=_Profiled(), shard=Shard(rank=0, ranks=2, kv_heads=4)
        )


class _Profiled:
    profile = PROFILE
    manager = None


@pytest.mark.parametrize("layerwise", [False, True])
def test_blocks_saved_at_two_ranks_hold_the_whole_model_s_kv(runtime, layerwise):
    kv = model_pages()
    pages = list(range(4, 12))
    keys = [uuid.uuid4(), uuid.uuid4()]
    ranks = halves(runtime, kv, 2)
    for half in ranks:
        half.layerwise_saves = layerwise
    step(ranks, saving(keys, pages))
    assert ranks[0].take_report().saved == {"w": 2}
    second = ranks[1].take_report()
    assert second is None or not second.saved  # the first rank stores the blocks
    for key, want in zip(keys, whole_blocks(kv, keys, pages), strict=True):
        got = LAYOUT.empty()
        runtime.store.get(key, out=got, tiers=["host"])
        assert torch.equal(got, want)


@pytest.mark.parametrize("readers", [1, 2, 4])
def test_blocks_written_at_two_ranks_serve_one_two_and_four(runtime, readers):
    source = model_pages(seed=1)
    keys = [uuid.uuid4(), uuid.uuid4()]
    step(halves(runtime, source, 2), saving(keys, list(range(8))))
    target = model_pages(seed=2)
    pages = [9, 10, 11, 12, 13, 14, 15, 3]
    ranks = halves(runtime, target, readers)
    step(ranks, loading(keys, pages, end=2 * LAYOUT.block_tokens))
    for half in ranks:
        assert half.take_invalid() == set()
        paged = half.paged
        assert paged is not None
        shard = half.shard
        theirs = PagedKV(list(rank_pages(source, shard).values()), kind="cpu-vec", layout=half.share_layout)
        for layer in range(LAYOUT.layers):
            assert torch.equal(paged.k[layer][pages], theirs.k[layer][:8])
            assert torch.equal(paged.v[layer][pages], theirs.v[layer][:8])


def test_a_rank_that_cannot_copy_its_share_stores_nothing_and_stalls_no_one(runtime):
    kv = model_pages()
    keys = [uuid.uuid4()]
    ranks = halves(runtime, kv, 2)
    broken = ranks[1]
    assert broken.paged is not None

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003 - this rank's pages cannot be read
        raise RuntimeError("page gather failed")

    broken.paged.gather = fail  # type: ignore[method-assign]
    step(ranks, saving(keys, list(range(4))))
    assert not runtime.store.tier("host").contains(keys[0])
    assert runtime.manager.counters.get("write_back.incomplete") == 1


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_block_computed_over_pages_one_rank_failed_to_load_is_stored_by_no_rank(runtime, layerwise):
    """Only the rank whose read failed knows, when the step ends, that its pages hold the wrong KV:
    it marks its share of the step's new block poisoned, and the first rank stores none of it."""
    kv = model_pages()
    present = [uuid.uuid4()]
    ranks = halves(runtime, kv, 2)
    step(ranks, saving(present, list(range(4))))
    for half in ranks:
        half.layerwise_saves = layerwise
    failing = ranks[1]
    real_read = failing.manager.store.get_layers

    def corrupt_here(keys, **kwargs):  # noqa: ANN001, ANN003 - this rank's copy fails its checksum
        from concurrent.futures import Future

        from worker.dataplane.errors import BlockCorrupt

        futures = real_read(keys, **kwargs)
        for i, key in enumerate(keys):
            futures[i].exception()
            failed: Future = Future()
            failed.set_exception(BlockCorrupt(key, tier="host", reason="checksum mismatch on this rank"))
            futures[i] = failed
        return futures

    failing.manager = copy.copy(failing.manager)
    failing.manager.store = copy.copy(failing.manager.store)
    failing.manager.store.get_layers = corrupt_here  # type: ignore[method-assign]
    meta = loading(present, list(range(8, 16)), LAYOUT.block_tokens)
    new = uuid.uuid4()
    meta.saves = [
        SaveSpec(request_id="q", namespace="default", pages=list(range(8, 16)), blocks=[(1, new, uuid.uuid4())])
    ]
    meta.step = 2
    step(ranks, meta)
    assert failing.take_invalid() == set(range(8, 12)) and ranks[0].take_invalid() == set()
    assert not runtime.store.tier("host").contains(new)
    assert runtime.manager.counters.get("write_back.poisoned") >= 1


def test_a_load_that_failed_on_one_rank_failed_for_the_step():
    """vLLM folds every rank's report into the first's: a failure anywhere is the load's, and a
    counter is counted once however many ranks counted it."""
    fine = StrataWorkerMeta(
        loads={"q": LoadReport([0.1, 0.2], [], 0.3, [], {"host": 2})}, counts={"hit_tokens": 64}, saved={"w": 1}
    )
    failed = StrataWorkerMeta(
        loads={"q": LoadReport([0.1], [], 0.3, [], {"host": 2}, failure="block 1: checksum mismatch")},
        counts={"hit_tokens": 64, "load_failures": 1},
    )
    merged = fine.aggregate(failed)
    assert merged.loads["q"].failure == "block 1: checksum mismatch"
    assert merged.counts == {"hit_tokens": 64, "load_failures": 1}
    assert merged.saved == {"w": 1}


def test_data_parallel_is_served_one_worker_per_rank_and_refused_past_that_naming_the_setting():
    from types import SimpleNamespace

    from worker.dataplane.connectors.vllm.runtime import check_engine

    def config(tensor: int, pipeline: int, data: int) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, data_parallel_size=data
            ),
        )

    for served in ((2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)):
        check_engine(config(*served))
    for refused in ((2, 1, 2), (1, 2, 2)):
        with pytest.raises(ValueError, match="mixture-of-experts model, each data-parallel rank must be one worker"):
            check_engine(config(*refused))


def test_stages_hold_their_own_layers():
    stages = [Shard(rank=0, ranks=2, kv_heads=4, stage=stage, stages=STAGES) for stage in range(2)]
    assert [shard.layers(LAYOUT) for shard in stages] == [range(0, 1), range(1, 2)]
    assert [shard.local(1, LAYOUT) for shard in stages[1:]] == [0]
    assert stages[0].layout(LAYOUT).block_bytes == LAYOUT.block_bytes // 4  # half the heads of half the layers
    assert stages[0].world == 4 and not stages[0].whole
    assert Shard(rank=0, ranks=1, kv_heads=4).whole
    with pytest.raises(ValueError, match="the stages end at 3"):
        Shard(rank=0, ranks=1, kv_heads=4, stages=((0, 1), (1, 3))).layout(LAYOUT)
    with pytest.raises(ValueError, match="pipeline stage 2 is outside 0..1"):
        Shard(rank=0, ranks=1, kv_heads=4, stage=2, stages=STAGES)


@pytest.mark.parametrize(("ranks", "layerwise"), [(1, False), (2, False), (2, True)])
def test_blocks_saved_at_two_stages_hold_the_whole_model_s_kv(runtime, ranks, layerwise):
    kv = model_pages(seed=3)
    pages = list(range(4, 12))
    keys = [uuid.uuid4(), uuid.uuid4()]
    model = halves(runtime, kv, ranks, stages=2)
    for half in model:
        half.layerwise_saves = layerwise
    step(model, saving(keys, pages))
    assert model[0].take_report().saved == {"w": 2}
    for key, want in zip(keys, whole_blocks(kv, keys, pages), strict=True):
        got = LAYOUT.empty()
        runtime.store.get(key, out=got, tiers=["host"])
        assert torch.equal(got, want)


def test_blocks_written_at_one_rank_serve_two_stages_of_two_ranks(runtime):
    source = model_pages(seed=4)
    keys = [uuid.uuid4(), uuid.uuid4()]
    step(halves(runtime, source, 1), saving(keys, list(range(8))))
    target = model_pages(seed=5)
    pages = [9, 10, 11, 12, 13, 14, 15, 3]
    model = halves(runtime, target, 2, stages=2)
    step(model, loading(keys, pages, end=2 * LAYOUT.block_tokens))
    for half in model:
        assert half.take_invalid() == set()
        assert half.take_report().loads["q"].failure == ""
        paged = half.paged
        assert paged is not None
        theirs = PagedKV(list(rank_pages(source, half.shard).values()), kind="cpu-vec", layout=half.share_layout)
        assert len(paged.k) == 1  # the stage's one layer
        assert torch.equal(paged.k[0][pages], theirs.k[0][:8])
        assert torch.equal(paged.v[0][pages], theirs.v[0][:8])


def test_a_rank_s_kv_caches_must_be_its_stage_s_layers(runtime):
    half = WorkerHalf(
        runtime,
        shard=Shard(rank=0, ranks=1, kv_heads=4, stage=1, stages=STAGES),
        gather=Group(2).gather_for(1),
    )
    wrong = rank_pages(model_pages(), Shard(rank=0, ranks=1, kv_heads=4, stage=0, stages=STAGES))
    with pytest.raises(ValueError, match=r"KV caches are of layers \[0\], its pipeline stage holds layers 1..1"):
        half.register(wrong, dict.fromkeys(wrong, "cpu-vec"), lambda name: int(name.split(".")[2]))
