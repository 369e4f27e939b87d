"""Chat-peak protects the device tier: the engine's working set holds a low-priority class to its
share while realtime tenants keep theirs; the policies in force reach the engine through the node."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.engine.conftest import engine_for, layout_for
from worker.dataplane.engine.working_set import ClassShare

DEVICE_BLOCKS = 20


def _prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(16 * blocks + 3)]


@pytest.fixture
def engine(models, make_store):  # type: ignore[no-untyped-def]
    model = models("tiny", "float32")
    store = make_store(model, ("device", "host"), blocks=DEVICE_BLOCKS)
    engine = engine_for(model, store, keep_in_device=True, write_back_tier="host")
    yield engine
    engine.close()


def test_a_batch_tenant_cannot_take_more_than_its_device_share(engine):
    block_bytes = layout_for(engine.model).block_bytes
    engine.working_set.set_shares([ClassShare("default", 0.9), ClassShare("batch", 0.1, ("bulk",))], version=5)
    chat = _prompt(1, 4)
    engine.generate(chat, max_tokens=1, namespace="chat")
    chat_blocks = engine.working_set.used_bytes("default") // block_bytes
    assert chat_blocks == 4
    for seed in range(2, 8):  # 6 long batch documents, 5 blocks each: 30 blocks for 2 pages of room
        engine.generate(_prompt(seed, 5), max_tokens=1, namespace="bulk")
        assert engine.working_set.used_bytes("batch") <= 0.1 * DEVICE_BLOCKS * block_bytes
    assert engine.working_set.used_bytes("default") // block_bytes == chat_blocks
    # The realtime tenant's next turn is served from the device tier, untouched by the batch flood.
    again = engine.generate(chat, max_tokens=1, namespace="chat")
    assert again.trace.hit_blocks_by_tier.get("device", 0) == 4


def test_without_shares_the_batch_flood_pushes_the_chat_prefix_out(engine):
    chat = _prompt(1, 4)
    engine.generate(chat, max_tokens=1, namespace="chat")
    for seed in range(2, 8):
        engine.generate(_prompt(seed, 5), max_tokens=1, namespace="bulk")
    again = engine.generate(chat, max_tokens=1, namespace="chat")
    assert again.trace.hit_blocks_by_tier.get("device", 0) == 0  # what chat-peak exists to prevent


def test_the_node_applies_the_chat_peak_classes_from_the_policies_in_force(engine, db):
    from controlplane.policies.models import PriorityClass
    from controlplane.policies.services import mode_activate, priorityclass_update
    from controlplane.policies.snapshot import policies_snapshot
    from worker.dataplane.config import load_config
    from worker.node import NodeRuntime

    priorityclass_update(priority_class=PriorityClass.objects.get(name="batch"), namespaces=["bulk"])
    mode_activate(name="chat-peak")
    runtime = NodeRuntime(load_config(environ={}))
    runtime.engine = engine
    runtime.policies_refresh()
    snapshot = policies_snapshot()
    assert runtime.policy_version == snapshot.version == engine.working_set.version
    assert engine.working_set.class_of("bulk") == "batch"
    assert engine.working_set.cap_bytes("batch") == int(0.1 * DEVICE_BLOCKS) * layout_for(engine.model).block_bytes
    # A late message carrying an older version changes nothing.
    old = [dataclasses.asdict(c) for c in snapshot.classes]
    assert not runtime.apply_policies(version=snapshot.version - 1, classes=old)
    with pytest.raises(ValueError, match="device_share"):
        runtime.apply_policies(version=snapshot.version + 1, classes=[{"name": "batch", "device_share": 2}])
    assert engine.working_set.version == snapshot.version
