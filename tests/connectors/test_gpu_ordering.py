"""The order of a GPU's layer-wise saves: each layer is copied out of the pages on a stream of its
own once the compute stream has written it, and the compute stream waits for the step's copies
before its next work (vLLM hands a page to another request once the step ends, and the next
step's kernels write it). On the CPU with streams that record what was queued, in what order; on
CUDA (skipped without it) with vLLM-shaped pages overwritten at once by the next step. The module
needs no conftest (the GPU script runs it alone: `gpu_side_by_side checks`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.connectors.conftest import local_runtime
from tests.connectors.test_worker_half import LAYOUT, NAMES, PAGE, PROFILE, engine_pages, run_step
from worker.dataplane.connectors.vllm.metadata import SaveSpec, StrataMetadata
from worker.dataplane.connectors.vllm.worker_half import WorkerHalf


class Journal:
    """Streams and events that write down what is queued on them."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, ...]] = []
        self._ids = itertools.count()
        self.current = "compute"

    def applies(self, device: torch.device) -> bool:
        return True

    def side(self, device: torch.device) -> Stream:
        return Stream(self, "side")

    def compute(self, device: torch.device) -> Stream:
        return Stream(self, "compute")

    def event(self) -> Event:
        return Event(self, f"e{next(self._ids)}")

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        self.entries.append(("on", stream.name))
        yield
        self.entries.append(("off", stream.name))


class Stream:
    def __init__(self, journal: Journal, name: str) -> None:
        self.journal, self.name = journal, name

    def wait_event(self, event: Event) -> None:
        self.journal.entries.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        self.journal.entries.append(("synchronize", self.name))


class Event:
    def __init__(self, journal: Journal, name: str) -> None:
        self.journal, self.name = journal, name

    def record(self, stream: Stream) -> None:
        self.journal.entries.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.journal.entries.append(("host waits", self.name))


@pytest.fixture
def runtime(tmp_path: Path):
    name = f"strata-test-gpu-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with local_runtime(tmp_path, name, PROFILE, "pages") as runtime:
            yield runtime
    finally:
        for pool in Path("/dev/shm").glob(f"{name}*"):
            pool.unlink(missing_ok=True)


def test_the_compute_stream_waits_for_the_step_s_copies_before_its_next_work(runtime):
    journal = Journal()
    half = WorkerHalf(runtime, layerwise_saves=True, streams=journal)  # type: ignore[arg-type]
    kv = engine_pages()
    half.register(kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]), block_size=PAGE)
    key = uuid.uuid4()
    spec = SaveSpec(request_id="r", namespace="default", pages=list(range(4)), blocks=[(0, key, uuid.uuid4())])
    run_step(half, StrataMetadata(saves=[spec], step=1))
    entries = journal.entries
    # Each layer: an event after its attention on the compute stream, which the side stream waits
    # for before the layer's copies are queued on it.
    for layer in range(LAYOUT.layers):
        record, wait, on = entries[4 * layer : 4 * layer + 3]
        assert record[0] == "record" and record[2] == "compute"
        assert wait == ("wait", "side", record[1]) and on == ("on", "side")
    # Then: an event after every copy on the side stream, which the compute stream waits for
    # before any later work, and which the save queue's thread waits for before it reads them.
    last_copy = max(i for i, entry in enumerate(entries) if entry == ("off", "side"))
    copied = entries[last_copy + 1]
    assert copied[0] == "record" and copied[2] == "side"
    assert entries[last_copy + 2] == ("wait", "compute", copied[1])
    assert ("host waits", copied[1]) in entries[last_copy + 3 :]
    assert runtime.store.tier("host").contains(key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu_side_by_side checks runs it)")
def test_a_page_overwritten_by_the_next_step_is_saved_as_the_step_left_it(runtime):
    """Pages of a bench-sized block on the GPU, overwritten on the compute stream right after the
    step (the next step's kernels writing a page vLLM handed to another request): the block
    stored holds what the step left, not what came after."""
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    kv = {
        name: torch.randn(64, LAYOUT.kv_heads, PAGE, 2 * LAYOUT.head_dim, generator=generator).to(device)
        for name in NAMES
    }
    want = {name: tensor.clone() for name, tensor in kv.items()}
    half = WorkerHalf(runtime, layerwise_saves=True)
    half.register(kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]), block_size=PAGE)
    keys = [uuid.uuid4() for _ in range(8)]
    pages = list(range(32))
    blocks: list[tuple[int, uuid.UUID, uuid.UUID]] = [(i, key, uuid.uuid4()) for i, key in enumerate(keys)]
    half.bind(StrataMetadata(saves=[SaveSpec(request_id="r", namespace="default", pages=pages, blocks=blocks)]))
    for name in NAMES:
        half.save_layer(name)
    half.finish_step()
    for tensor in kv.values():  # the next step, on the compute stream
        tensor.mul_(-1.0).add_(7.0)
    assert half.flush_saves(timeout=60)
    from worker.dataplane.connectors.pages import PagedKV

    expected = PagedKV([want[name].cpu() for name in NAMES], kind="cpu-vec", layout=LAYOUT)
    for index, key in enumerate(keys):
        block, got = LAYOUT.empty(), LAYOUT.empty()
        expected.gather(block, index=index, pages=pages)
        runtime.store.get(key, out=got, tiers=["host"])
        assert torch.equal(got, block), f"block {index} holds the next step's bytes"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_pages_of_another_size_than_vllm_s_block_size_are_refused_at_registration(runtime, device):
    """vLLM's scheduler counts pages of block_size tokens: KV tensors whose pages hold another
    count are refused, naming both, before any page is read or written."""
    kv = {name: tensor.to(device) for name, tensor in engine_pages().items()}
    with pytest.raises(ValueError, match=rf"pages of {PAGE} tokens, vLLM's block_size is {2 * PAGE}"):
        WorkerHalf(runtime).register(
            kv, dict.fromkeys(kv, "cpu-vec"), lambda name: int(name.split(".")[2]), block_size=2 * PAGE
        )
