"""Tensor parallel in the worker half, on CPU pages and a real host tier: ranks run in threads of
one process and meet in a gather as vLLM's tensor-parallel group would. Blocks saved at two ranks
hold the whole model's KV (the bytes one rank would save), and serve one, two and four ranks."""

from __future__ import annotations

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
    """A rank's pages: its heads of every layer (vLLM's CPU_ATTN tensor per rank)."""
    return {name: tensor[:, shard.first : shard.first + shard.heads].contiguous() for name, tensor in kv.items()}


class Group:
    """A tensor-parallel group of threads: the gather every rank calls once per step with saves."""

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


def halves(runtime: Runtime, kv: dict[str, torch.Tensor], ranks: int) -> list[WorkerHalf]:
    group = Group(ranks)
    result = []
    for rank in range(ranks):
        shard = Shard(rank=rank, ranks=ranks, kv_heads=LAYOUT.kv_heads)
        half = WorkerHalf(runtime, shard=shard, gather=group.gather_for(rank) if ranks > 1 else None)
        own = rank_pages(kv, shard)
        half.register(own, dict.fromkeys(own, "CPU_ATTN"), lambda name: int(name.split(".")[2]))
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
    paged = PagedKV(list(kv.values()), kind="rows", layout=LAYOUT)
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
        theirs = PagedKV(list(rank_pages(source, shard).values()), kind="rows", layout=half.share_layout)
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


@pytest.mark.parametrize(
    ("setting", "flag"),
    [("pipeline_parallel_size", "--pipeline-parallel-size"), ("data_parallel_size", "--data-parallel-size")],
)
def test_pipeline_and_data_parallel_are_refused_at_start_naming_the_setting(setting, flag):
    from types import SimpleNamespace

    from worker.dataplane.connectors.vllm.runtime import check_engine

    parallel = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "data_parallel_size": 1, setting: 2}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        parallel_config=SimpleNamespace(**parallel),
    )
    with pytest.raises(ValueError, match=f"{flag} must be 1"):
        check_engine(config)
    check_engine(
        SimpleNamespace(
            kv_transfer_config=config.kv_transfer_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1),
        )
    )  # tensor parallel is served
