"""Write-through to L3 between two engines that share only the remote tier (each its own host pool
and disk): turn 2 of a conversation on the other engine loads turn 1's prefix from L3, with the
same greedy tokens as a run without any cache; on-demotion classes write nothing there; an L3 that
is down at write-back keeps the local copy."""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.engine.conftest import BLOCK_TOKENS, engine_for, layout_for
from worker.dataplane.engine.engine import Engine
from worker.dataplane.remote_write import RemoteWritePolicy
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier

CHAT_THROUGH = [
    {"name": "default", "namespaces": [], "remote_write": "on-demotion"},
    {"name": "shared", "namespaces": ["chat"], "remote_write": "write-through"},
]


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(length - 1)]


@pytest.fixture
def two_nodes(models, tmp_path: Path, redis_url: str) -> Iterator[Callable[..., tuple[Engine, Engine, RemoteTier]]]:
    """Two engines of the tiny model, each with its own host pool and disk, sharing one L3 prefix."""
    prefix = f"strata-fleettest-{uuid.uuid4().hex[:8]}"
    stores: list[TieredStore] = []
    pools: list[Path] = []

    def build(remote_url: str = redis_url) -> tuple[Engine, Engine, RemoteTier]:
        model = models("tiny")
        layout = layout_for(model)
        capacity = 64 * layout.block_bytes
        engines = []
        for name in ("a", "b"):
            pool = f"strata-fleettest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            pools.append(Path("/dev/shm") / pool)
            client = redis.Redis.from_url(remote_url, socket_timeout=2, socket_connect_timeout=2)
            store = TieredStore(
                layout=layout,
                tiers=[
                    HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
                    DiskTier(layout=layout, capacity_bytes=capacity, path=tmp_path / f"disk-{name}"),
                    RemoteTier(layout=layout, capacity_bytes=capacity, client=client, prefix=prefix),
                ],
            )
            stores.append(store)
            engines.append(engine_for(model, store, write_back_tier="host"))
        return engines[0], engines[1], stores[-1].tier("remote")  # type: ignore[return-value]

    yield build
    for store in stores:
        store.close()
    for pool in pools:
        pool.unlink(missing_ok=True)
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def test_turn_two_on_the_other_node_loads_turn_one_from_l3(two_nodes):
    a, b, remote = two_nodes()
    for engine in (a, b):
        engine.offload.remote_writer.set_classes(CHAT_THROUGH)
    turn1 = prompt_of(90, seed=11)
    reply = a.generate(turn1, max_tokens=20, namespace="chat").output_ids
    # Write-through: the copies are in L3 when the answer returns (no drain needed).
    written = (90 + 19) // BLOCK_TOKENS
    assert a.offload.counters.get("write_through.blocks") == written
    assert len(remote.keys()) == written
    # A's own copies stay in its host tier beside the L3 ones.
    assert a.offload.store.tier("host").usage().blocks == written
    turn2 = turn1 + reply + prompt_of(40, seed=12)[1:]
    second = b.generate(turn2, max_tokens=8, namespace="chat")
    assert second.trace.hit_blocks_by_tier == {"remote": written}
    assert second.trace.cached_tokens == written * BLOCK_TOKENS
    cold = b.generate(turn2, max_tokens=8, namespace="chat", use_cache=False)
    assert second.output_ids == cold.output_ids
    # B keeps what it read from L3 in its own host tier, beside its own new blocks, and writes
    # only those new ones through (the L3 copies are there already).
    b_blocks = (len(turn2) + 7) // BLOCK_TOKENS
    assert b.offload.store.tier("host").usage().blocks == b_blocks
    assert b.offload.counters.get("write_through.blocks") == b_blocks - written
    assert len(remote.keys()) == b_blocks
    # Turn 3 of the conversation comes back to B: everything B saw is local now.
    turn3 = turn2 + second.output_ids + prompt_of(20, seed=15)[1:]
    third = b.generate(turn3, max_tokens=4, namespace="chat")
    assert third.trace.hit_blocks_by_tier == {"host": b_blocks}
    assert third.output_ids == b.generate(turn3, max_tokens=4, namespace="chat", use_cache=False).output_ids


def test_the_default_on_demotion_writes_nothing_to_l3(two_nodes):
    a, b, remote = two_nodes()
    for engine in (a, b):
        engine.offload.remote_writer.set_classes(CHAT_THROUGH)
    prompt = prompt_of(80, seed=13)
    a.generate(prompt, max_tokens=4, namespace="default")
    assert a.offload.remote_writer.drain(timeout=30)
    assert remote.keys() == [] and a.offload.counters.get("write_through.blocks") == 0
    again = b.generate(prompt, max_tokens=4, namespace="default")
    assert again.trace.cached_tokens == 0


def test_a_default_class_that_writes_through_covers_unnamed_namespaces_only():
    policy = RemoteWritePolicy.from_classes(
        [
            {"name": "default", "namespaces": [], "remote_write": "write-through"},
            {"name": "batch", "namespaces": ["jobs"]},
        ]
    )
    assert policy.writes_through("anyone") and not policy.writes_through("jobs")
    with pytest.raises(ValueError, match="remote_write: class 'gold' has 'always'"):
        RemoteWritePolicy.from_classes([{"name": "gold", "namespaces": [], "remote_write": "always"}])
    with pytest.raises(ValueError, match="namespaces: class 'gold' needs a list"):
        RemoteWritePolicy.from_classes([{"name": "gold", "namespaces": "chat", "remote_write": "write-through"}])


def test_an_l3_outage_at_write_back_keeps_the_local_copy(two_nodes):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]  # closed when the block ends: nothing listens there
    a, _, _ = two_nodes(remote_url=f"redis://127.0.0.1:{dead}/0")
    a.offload.remote_writer.set_classes(CHAT_THROUGH)
    prompt = prompt_of(70, seed=14)
    first = a.generate(prompt, max_tokens=4, namespace="chat")
    assert a.offload.remote_writer.drain(timeout=30)
    blocks = (70 + 3) // BLOCK_TOKENS
    assert first.trace.written_blocks == blocks
    assert a.offload.counters.get("write_through.failed") == blocks
    assert a.offload.store.tier("host").usage().blocks == blocks
    warm = a.generate(prompt, max_tokens=4, namespace="chat")
    assert warm.trace.hit_blocks_by_tier == {"host": 70 // BLOCK_TOKENS}
    assert warm.output_ids == first.output_ids
