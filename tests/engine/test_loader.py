"""The layer loader: a thread of its own, or inline at each layer's sync point for CPU-memory reads."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from tests.engine.test_engine import prompt_of
from worker.dataplane.engine import engine as engine_module
from worker.dataplane.engine.cache import LoadFailed
from worker.dataplane.engine.loader import Hit, LayerLoader, PrefixBuffers


def _stored(store, count: int) -> tuple[list[uuid.UUID], list[torch.Tensor]]:
    keys = [uuid.uuid4() for _ in range(count)]
    blocks = [torch.randint(0, 256, (store.layout.block_bytes,), dtype=torch.uint8) for _ in keys]
    for key, block in zip(keys, blocks, strict=True):
        store.put(key, block, tier="device")
    return keys, blocks


def _inline_loader(store, keys: list[uuid.UUID]) -> tuple[LayerLoader, PrefixBuffers]:
    buffers = PrefixBuffers(layout=store.layout, blocks=len(keys), device=torch.device("cpu"))
    loader = LayerLoader(store=store, hits=[Hit(i, k, "device") for i, k in enumerate(keys)], buffers=buffers,
                         inline=True)
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
