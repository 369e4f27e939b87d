"""The layer loader: a thread of its own, or inline at each layer's sync point for CPU-memory reads;
what each tier served; on a device other than the CPU, staging in host memory and a copy per layer."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid

import pytest
import torch

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from tests.engine.test_engine import prompt_of
from worker.dataplane.engine import engine as engine_module
from worker.dataplane.layer_loader.loader import Hit, LayerLoader, PrefixBuffers
from worker.dataplane.layout import BlockLayout
from worker.dataplane.prefix.cache import LayerGate, LoadFailed
from worker.dataplane.tiers.base import resolved


def _stored(store, count: int) -> tuple[list[uuid.UUID], list[torch.Tensor]]:
    keys = [uuid.uuid4() for _ in range(count)]
    blocks = [torch.randint(0, 256, (store.layout.block_bytes,), dtype=torch.uint8) for _ in keys]
    for key, block in zip(keys, blocks, strict=True):
        store.put(key, block, tier="device")
    return keys, blocks


def _inline_loader(store, keys: list[uuid.UUID]) -> tuple[LayerLoader, PrefixBuffers]:
    buffers = PrefixBuffers(layout=store.layout, blocks=len(keys), device=torch.device("cpu"))
    loader = LayerLoader(
        store=store, hits=[Hit(i, k, "device") for i, k in enumerate(keys)], buffers=buffers, inline=True
    )
    return loader.start(), buffers


def test_an_inline_loader_reads_each_layer_when_its_gate_is_waited(models, make_store):
    model = models("tiny")
    store = make_store(model, ("device",))
    layout = store.layout
    keys, blocks = _stored(store, 5)
    loader, buffers = _inline_loader(store, keys)
    assert loader._thread is None and loader.timings == []  # nothing is read before it is needed
    loader.gates[0].wait()
    assert [t.layer for t in loader.timings] == [0]
    loader.gates[1].wait()
    assert [t.layer for t in loader.timings] == [0, 1]
    for layer in (0, 1):
        offset, nbytes = layout.span(layer)
        for j, block in enumerate(blocks):
            assert torch.equal(buffers.slot(layer, j), block[offset : offset + nbytes])
    loader.join()  # no thread to wait for
    assert loader.finished_at >= loader.started_at > 0


@pytest.mark.parametrize("stop", ["a block vanishes", "the load is cancelled"])
def test_an_inline_loader_fails_the_layers_it_cannot_read_and_every_later_one(models, make_store, stop):
    model = models("tiny-qwen2")
    store = make_store(model, ("device",))
    keys, _ = _stored(store, 4)
    loader, _ = _inline_loader(store, keys)
    loader.gates[0].wait()
    if stop == "a block vanishes":
        store.delete(keys[2])
    else:
        loader.cancel()
    with pytest.raises(LoadFailed, match="block 2|cancelled") as failed:
        loader.gates[1].wait()
    assert failed.value.layer == 1 and failed.value.block_index == (2 if stop == "a block vanishes" else 0)
    assert all(gate.is_set() for gate in loader.gates)
    with pytest.raises(LoadFailed):
        loader.wait_all()


@pytest.mark.parametrize(("tier", "inline"), [("device", True), ("host", False), ("disk", False)])
def test_the_engine_loads_inline_only_from_the_device_tier_on_the_cpu(models, make_store, monkeypatch, tier, inline):
    made: list[LayerLoader] = []

    class Recorded(LayerLoader):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            made.append(self)

    monkeypatch.setattr(engine_module, "LayerLoader", Recorded)
    model = models("tiny")
    engine = engine_for(model, make_store(model, (tier,)))
    prompt = prompt_of(150, seed=31)
    cold = engine.generate(prompt, max_tokens=6, use_cache=False)
    engine.generate(prompt, max_tokens=6)
    warm = engine.generate(prompt, max_tokens=6, layerwise=True)
    assert warm.trace.cached_tokens == (150 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert warm.output_ids == cold.output_ids and torch.equal(warm.first_logits, cold.first_logits)
    assert [loader.inline for loader in made] == [inline]
    assert len(warm.trace.layer_stall_s) == len(warm.trace.layer_loaded_at_s) == model.layers


def test_a_mixed_load_credits_each_tier_with_what_it_served(models, make_store):
    model = models("tiny")
    store = make_store(model, ("host", "disk"))
    layout = store.layout
    keys = [uuid.uuid4() for _ in range(6)]
    for i, key in enumerate(keys):
        block = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8)
        store.put(key, block, tier="host" if i < 3 else "disk")
        if i == 2:
            store.put(key, block, tier="disk")  # also on disk: its host copy is about to vanish
    hits = [Hit(i, key, "host" if i < 3 else "disk") for i, key in enumerate(keys)]
    original = store.get_layers

    def host_copy_gone_after_lookup(keys_, **kwargs):
        store.delete(keys[2], tier="host")  # after the lookup planned block 2 on host
        return original(keys_, **kwargs)

    store.get_layers = host_copy_gone_after_lookup
    buffers = PrefixBuffers(layout=layout, blocks=len(keys), device=torch.device("cpu"))
    loader = LayerLoader(store=store, hits=hits, buffers=buffers).start()
    loader.wait_all()
    loader.join()
    served = {load.tier: load for load in loader.tier_loads()}
    # The tier that served a block is credited, not the one it was found in: block 2 came from disk.
    assert {tier: load.bytes for tier, load in served.items()} == {
        "host": 2 * layout.block_bytes,
        "disk": 4 * layout.block_bytes,
    }
    for load in served.values():
        assert 0 < load.seconds <= loader.finished_at - loader.started_at


def test_an_inline_load_credits_its_reading_time_to_the_hits_tier(models, make_store):
    model = models("tiny")
    store = make_store(model, ("device",))
    keys, _ = _stored(store, 3)
    loader, _ = _inline_loader(store, keys)
    loader.wait_all()
    (load,) = loader.tier_loads()
    assert load.tier == "device" and load.bytes == 3 * store.layout.block_bytes
    assert load.seconds == pytest.approx(sum(t.finished - t.started for t in loader.timings))


def test_prefix_buffers_live_on_the_given_device_in_the_model_dtype():
    layout = BlockLayout(layers=3, kv_heads=2, head_dim=8, block_tokens=BLOCK_TOKENS, dtype=torch.bfloat16)
    buffers = PrefixBuffers(layout=layout, blocks=4, device=torch.device("meta"))
    assert buffers.device == torch.device("meta")
    assert all(raw.device.type == "meta" and raw.numel() == 4 * layout.layer_bytes for raw in buffers.raw)
    assert all(typed.dtype == torch.bfloat16 and typed.shape == (4, 2, BLOCK_TOKENS, 2, 8) for typed in buffers.typed)
    keys, values = buffers.kv_parts(1, 2 * BLOCK_TOKENS + 5)
    assert [k.shape[2] for k in keys] == [BLOCK_TOKENS, BLOCK_TOKENS, 5]
    assert all(k.device.type == "meta" and k.shape == (1, 2, k.shape[2], 8) for k in keys + values)


def test_the_engine_allocates_the_prefix_buffers_on_the_model_device(models, make_store, monkeypatch):
    made: list[PrefixBuffers] = []

    class Recorded(PrefixBuffers):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            made.append(self)

    monkeypatch.setattr(engine_module, "PrefixBuffers", Recorded)
    # An indexed CPU device is its own torch.device: the buffers must be allocated on the model's
    # device object, not on a CPU chosen for them (on a GPU that is where attention reads them).
    model = dataclasses.replace(models("tiny", "bfloat16"), device=torch.device("cpu", 0))
    engine = engine_for(model, make_store(model, ("host",)))
    prompt = prompt_of(70, seed=32)
    engine.generate(prompt, max_tokens=2)
    assert engine.generate(prompt, max_tokens=2).trace.cached_tokens == 64
    (buffers,) = made
    assert buffers.device == torch.device("cpu", 0) and buffers.typed[0].dtype == torch.bfloat16


def test_off_the_cpu_blocks_below_l1_are_staged_in_host_memory_and_copied_per_run(models, make_store):
    # The device-agnostic half of GPU loading, with the meta device standing in for a GPU (no
    # stream, no event): device-tier blocks are read in place, every other block into host
    # memory, and each layer's staged blocks are copied to the device before its gate opens.
    model = models("tiny")
    store = make_store(model, ("device", "host"))
    layout = store.layout
    keys = [uuid.uuid4() for _ in range(5)]
    blocks = [torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8) for _ in keys]
    tiers = ["device", "host", "host", "device", "host"]
    for key, block, tier in zip(keys, blocks, tiers, strict=True):
        store.put(key, block, tier=tier)
    destinations: dict[uuid.UUID, str] = {}
    original = store.get_layers

    def recorded(keys_, *, layers, outs, **kwargs):
        for key, out in zip(keys_, outs, strict=True):
            destinations[key] = out.device.type
        device_keys = [i for i, out in enumerate(outs) if out.device.type == "meta"]
        # Nothing can be read into meta memory: only the staged (host-memory) reads run.
        futures = original(
            [k for i, k in enumerate(keys_) if i not in device_keys],
            layers=layers,
            outs=[o for i, o in enumerate(outs) if i not in device_keys],
            **kwargs,
        )
        answer = iter(futures)
        return [resolved(None) if i in device_keys else next(answer) for i in range(len(keys_))]

    store.get_layers = recorded
    buffers = PrefixBuffers(layout=layout, blocks=len(keys), device=torch.device("meta"))
    with torch.inference_mode():  # as the engine builds it (the tiers' threads then write outside it)
        loader = LayerLoader(
            store=store, hits=[Hit(i, k, t) for i, (k, t) in enumerate(zip(keys, tiers, strict=True))], buffers=buffers
        ).start()
    loader.wait_all()
    loader.join()
    assert destinations == {key: "meta" if tier == "device" else "cpu" for key, tier in zip(keys, tiers, strict=True)}
    assert loader._staged == [1, 2, 4] and loader._staged_runs == [(1, 0, 2), (4, 2, 1)]
    assert loader._staging is not None and loader._staging.device.type == "cpu"
    for layer in range(layout.layers):
        offset, nbytes = layout.span(layer)
        for row, block in enumerate(loader._staged):
            assert torch.equal(loader._staging[layer, row], blocks[block][offset : offset + nbytes])
    assert all(gate.is_set() for gate in loader.gates) and len(loader.timings) == layout.layers


@pytest.mark.parametrize(
    ("staged", "runs"), [([], []), ([0], [(0, 0, 1)]), ([1, 2, 3, 5, 7, 8], [(1, 0, 3), (5, 3, 1), (7, 4, 2)])]
)
def test_staged_blocks_are_copied_in_runs_of_neighbours(staged, runs):
    from worker.dataplane.buffers import runs as runs_of

    assert runs_of(staged) == runs


def test_a_gate_opened_with_an_event_makes_the_compute_stream_of_its_device_wait(monkeypatch):
    # torch.cuda's stream stands in here (no GPU on the test machine): what is checked is that
    # the waiting thread's stream on the buffers' device is told to wait for the copy's event.
    waited: list[tuple[object, object]] = []

    class Stream:
        def __init__(self, device=None) -> None:
            self.device = device

        def wait_event(self, event) -> None:
            waited.append((self.device, event))

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    gate, plain = LayerGate(), LayerGate()
    copied = object()
    gate.open(cuda_event=copied, device=torch.device("cuda", 1))
    plain.open()
    assert gate.wait() >= 0 and plain.wait() >= 0
    assert waited == [(torch.device("cuda", 1), copied)]


def test_the_gpu_loading_sequence_with_stand_ins_for_the_cuda_calls(models, make_store, monkeypatch):
    # No GPU on the test machine: torch.cuda's streams and events are replaced by recorders and
    # the buffers, in CPU memory, are labelled cuda:0. What is checked is the order of the calls
    # and where every byte lands; the real asynchrony is the GPU's.
    calls: list[tuple] = []

    class Event:
        def record(self, stream) -> None:
            calls.append(("record", self, stream))

        def synchronize(self) -> None:
            calls.append(("synchronize", self))

    class Stream:
        def __init__(self, device=None) -> None:
            self.device = device

        def wait_event(self, event) -> None:
            calls.append(("wait", self, event))

    compute = Stream(torch.device("cuda", 0))

    def current_stream(device=None):
        assert device == torch.device("cuda", 0)
        return compute

    entered: list[Stream] = []

    @contextlib.contextmanager
    def on(stream):
        calls.append(("enter", stream))
        entered.append(stream)
        yield
        entered.pop()
        calls.append(("exit", stream))

    copies: list[bool] = []  # non_blocking of each copy queued on a stream
    copy = torch.Tensor.copy_

    def recorded_copy(self, src, non_blocking=False):
        if entered:
            copies.append(non_blocking)
        return copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded_copy)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, stream: calls.append(("keep", stream)), raising=False
    )
    model = models("tiny")
    store = make_store(model, ("device", "host"))
    layout = store.layout
    keys = [uuid.uuid4() for _ in range(4)]
    blocks = [torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8) for _ in keys]
    tiers = ["host", "device", "host", "host"]
    for key, block, tier in zip(keys, blocks, tiers, strict=True):
        store.put(key, block, tier=tier)
    buffers = PrefixBuffers(layout=layout, blocks=len(keys), device=torch.device("cpu"))
    buffers.device = torch.device("cuda", 0)
    loader = LayerLoader(
        store=store, hits=[Hit(i, k, t) for i, (k, t) in enumerate(zip(keys, tiers, strict=True))], buffers=buffers
    )
    stream = loader._stream
    assert isinstance(stream, Stream) and stream is not compute
    # The buffers are written only after the work queued before them on the compute stream, and
    # are kept from reuse while the loader's stream may still copy into them.
    (_, free, on_stream), *kept = calls
    assert on_stream is compute and kept == [("keep", stream)] * layout.layers
    calls.clear()
    copies.clear()
    loader.start()
    loader.join()  # every gate open: what the loader thread did, before anything waits
    assert calls[0] == ("synchronize", free) and all(gate.is_set() for gate in loader.gates)
    assert copies == [True, True] * layout.layers  # blocks 0 and 2-3: two runs a layer, asynchronous
    events = [call[1] for call in calls if call[0] == "record"]
    assert len(events) == layout.layers
    for layer, event in enumerate(events):
        at = calls.index(("record", event, stream))
        assert calls[at - 1] == ("enter", stream) and calls[at + 1] == ("exit", stream)
        assert loader.gates[layer]._cuda_event is event
    # Each layer's attention makes the compute stream wait for that layer's copy, nothing more.
    calls.clear()
    for gate in loader.gates:
        gate.wait()
    assert calls == [("wait", compute, event) for event in events]
    for layer in range(layout.layers):
        offset, nbytes = layout.span(layer)
        for j, block in enumerate(blocks):
            assert torch.equal(buffers.slot(layer, j), block[offset : offset + nbytes])
