"""A block in L3 rewritten by someone who did not register it is never served (real PostgreSQL
directory, real Redis as L3).

Every node holds the L3 address and can write any key there, with a header that is right for the
bytes it writes. Blocks written through to L3 the normal way register their checksum; a node that
then finds such a block in L3 loads it only if the copy still carries that checksum. A rewritten
copy fails its load at that block (the request recomputes from there), is quarantined (placement
corrupt, bytes dropped) and counted, and the blocks before it load as usual. Without a directory
there is nothing registered to check against: the copy's own header is all there is.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from tests.engine.conftest import BLOCK_TOKENS, engine_for, layout_for, redis_url  # noqa: F401 - fixtures
from worker.dataplane.directory import Directory
from worker.dataplane.engine.engine import Engine
from worker.dataplane.engine_metrics import EngineMetrics
from worker.dataplane.errors import BlockUnregistered
from worker.dataplane.hashing import BlockFingerprint
from worker.dataplane.layer_loader.loader import LayerLoader, PrefixBuffers
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Hit
from worker.dataplane.prefix.cache import LoadFailed
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier
from worker.postgres_directory import DirectoryOptions, PostgresDirectory

pytestmark = pytest.mark.django_db(transaction=True)

PROFILE = ModelProfile(
    model_id="test/l3-registered", layers=3, kv_heads=2, head_dim=8, dtype="float32", block_tokens=BLOCK_TOKENS
)
LAYOUT = block_layout(PROFILE)
WRITE_THROUGH = [{"name": "default", "namespaces": [], "remote_write": "write-through"}]
NODES = ("gpu-a", "gpu-b", "gpu-c")


@pytest.fixture
def directory() -> Iterator[PostgresDirectory]:
    from controlplane.directory.services import TierReport, namespace_ensure, node_heartbeat

    for name in NODES:
        node_heartbeat(
            name=name,
            host="h",
            heartbeat_seconds=5.0,
            tiers=[TierReport(tier="host", capacity_bytes=1 << 30, used_bytes=0)],
        )
    namespace_ensure(name="default")
    client = PostgresDirectory(
        options=DirectoryOptions(flush_interval_s=0.02, batch_size=500, lookup_timeout_ms=5000),
        announce=lambda **_: None,
    )
    yield client
    client.close()


@pytest.fixture
def stores(redis_url: str) -> Iterator[Callable[..., TieredStore]]:  # noqa: F811
    """Stores of one layout, each with its own host pool, all sharing one L3 prefix."""
    prefix = f"strata-l3registered-{uuid.uuid4().hex[:8]}"
    built: list[TieredStore] = []
    pools: list[Path] = []

    def build(layout=LAYOUT) -> TieredStore:
        pool = f"strata-l3registered-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pools.append(Path("/dev/shm") / pool)
        capacity = 16 * layout.block_bytes
        store = TieredStore(
            layout=layout,
            tiers=[
                HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
                RemoteTier(
                    layout=layout,
                    capacity_bytes=capacity,
                    client=redis.Redis.from_url(redis_url, socket_timeout=5),
                    prefix=prefix,
                ),
            ],
        )
        built.append(store)
        return store

    yield build
    for store in built:
        store.close()
    for pool in pools:
        pool.unlink(missing_ok=True)
    client = redis.Redis.from_url(redis_url)
    for name in client.scan_iter(f"{prefix}*"):
        client.delete(name)
    client.close()


def manager(store: TieredStore, node: str, directory: Directory | None) -> OffloadManager:
    from controlplane.directory.services import modelprofile_ensure

    modelprofile_ensure(profile=PROFILE)
    return OffloadManager(store=store, profile=PROFILE, node=node, directory=directory)


def block_of(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(LAYOUT.kv_shape, generator=generator), torch.randn(LAYOUT.kv_shape, generator=generator))
        for _ in range(LAYOUT.layers)
    ]
    return LAYOUT.pack(kv)


def write_through(writer: OffloadManager, directory: PostgresDirectory, blocks: int) -> list[BlockFingerprint]:
    """`blocks` blocks of a prompt kept by `writer` and written through to L3 the normal way."""
    writer.apply_policies(classes=WRITE_THROUGH)
    prints = writer.fingerprints(list(range(1, blocks * BLOCK_TOKENS + 1)), "default")
    registrations = [
        writer.store_block(
            key=fp.prefix_key, content_key=fp.content_key, position=fp.start, namespace="default", data=block_of(i)
        )
        for i, fp in enumerate(prints)
    ]
    copy = writer.register([r for r in registrations if r is not None])
    assert copy is not None
    copy.result(timeout=30)
    assert directory.flush(timeout=10)
    return prints


def forge(remote: RemoteTier, key: uuid.UUID, seed: int) -> str:
    """Rewrite a key in L3 as any node can: other bytes, under a header that is right for them."""
    return remote.put(key, block_of(seed)).checksum.hex


def registered(key: uuid.UUID) -> dict[str, tuple[str, str]]:
    """tier -> (checksum, state) of every copy of the block."""
    from controlplane.directory.models import Placement

    return {p.tier: (p.checksum, p.state) for p in Placement.objects.filter(block__prefix_key=key)}


def load(store: TieredStore, hits: list[Hit], *, verify: bool) -> tuple[LayerLoader, PrefixBuffers]:
    buffers = PrefixBuffers(layout=LAYOUT, blocks=len(hits), device=torch.device("cpu"))
    loader = LayerLoader(store=store, hits=hits, buffers=buffers, verify_remote=verify).start()
    loader.join()
    return loader, buffers


def assert_loaded(buffers: PrefixBuffers, seeds: list[int]) -> None:
    lb = LAYOUT.layer_bytes
    for j, seed in enumerate(seeds):
        block = block_of(seed)
        for layer in range(LAYOUT.layers):
            assert torch.equal(buffers.slot(layer, j), block[layer * lb : (layer + 1) * lb])


def test_a_forged_l3_block_fails_its_load_is_quarantined_and_counted(stores, directory):
    writer = manager(stores(), "gpu-a", directory)
    prints = write_through(writer, directory, blocks=3)
    keys = [fp.prefix_key for fp in prints]
    sums = [registered(key)["remote"][0] for key in keys]
    assert all(registered(key)["remote"][1] == "ready" for key in keys)

    reader = manager(stores(), "gpu-b", directory)
    assert reader.verifies_remote
    hits = reader.find_prefix(prints, "default")
    assert [(h.tier, h.checksum) for h in hits] == [("remote", s) for s in sums]

    forged = forge(writer.store.tier("remote"), keys[1], seed=99)  # type: ignore[arg-type]
    loader, _ = load(reader.store, hits, verify=True)
    with pytest.raises(LoadFailed) as failed:
        loader.gates[0].wait()
    assert failed.value.block_index == 1  # the request recomputes from the forged block on
    [cause] = failed.value.cause.causes
    assert isinstance(cause, BlockUnregistered) and (cause.stored, cause.registered) == (forged, sums[1])
    assert str(keys[1]) in str(cause)

    assert reader.quarantine(keys[1], failed.value.cause, "default") == ["remote"]
    assert directory.flush(timeout=10)
    assert registered(keys[1])["remote"] == (sums[1], "corrupt")
    assert registered(keys[0])["remote"] == (sums[0], "ready")
    assert not reader.store.tier("remote").contains(keys[1]), "the forged bytes are dropped"
    assert reader.counters.get("remote_unverified") == 1 and reader.counters.get("quarantined") == 1
    assert reader.store.stats()["remote.unverified"] >= 1  # reads refused: one per layer read in flight
    metrics = EngineMetrics(reader, "gpu-b", model="test").render().decode()
    assert 'strata_remote_unverified_total{node="gpu-b"} 1.0' in metrics

    loader, buffers = load(reader.store, hits[:1], verify=True)  # the block before it loads
    loader.wait_all()
    assert_loaded(buffers, [0])
    # The quarantined block is no hit any more; the prefix before it still is.
    assert [(h.key, h.tier) for h in reader.find_prefix(prints, "default")] == [(keys[0], "remote")]


def test_a_copy_this_node_lost_is_read_from_l3_only_as_registered(stores, directory):
    """The directory places block 0 in this node's host tier, which no longer holds it: the L3
    copy behind it is a hit with the remote copy's registered checksum (the same round trip),
    loads while genuine, and fails once rewritten."""
    node = manager(stores(), "gpu-a", directory)
    prints = write_through(node, directory, blocks=2)
    keys = [fp.prefix_key for fp in prints]
    node.store.delete(keys[0], tier="host")
    assert registered(keys[0])["host"][1] == "ready"  # stale: the directory does not know yet

    hits = node.find_prefix(prints, "default")
    assert [(h.tier, h.checksum) for h in hits] == [
        ("remote", registered(keys[0])["remote"][0]),
        ("host", ""),
    ]
    loader, buffers = load(node.store, hits, verify=True)
    loader.wait_all()
    assert_loaded(buffers, [0, 1])

    forge(node.store.tier("remote"), keys[0], seed=98)  # type: ignore[arg-type]
    loader, _ = load(node.store, hits, verify=True)
    with pytest.raises(LoadFailed) as failed:
        loader.gates[0].wait()
    assert failed.value.block_index == 0
    assert node.quarantine(keys[0], failed.value.cause, "default") == ["remote"]
    assert directory.flush(timeout=10)
    assert registered(keys[0])["remote"][1] == "corrupt"


def test_without_a_directory_l3_copies_are_checked_against_themselves(stores, directory):
    writer = manager(stores(), "gpu-a", directory)
    prints = write_through(writer, directory, blocks=2)
    forge(writer.store.tier("remote"), prints[1].prefix_key, seed=97)  # type: ignore[arg-type]
    alone = manager(stores(), "gpu-c", None)
    assert not alone.verifies_remote
    hits = alone.find_prefix(prints, "default")
    assert [(h.tier, h.checksum) for h in hits] == [("remote", ""), ("remote", "")]
    loader, buffers = load(alone.store, hits, verify=alone.verifies_remote)
    loader.wait_all()
    assert_loaded(buffers, [0, 97])  # nothing registered to tell a rewritten value from the real one


@pytest.fixture
def engines(models, stores, directory) -> Callable[[], tuple[Engine, Engine]]:
    """Two engines of the tiny model on two nodes, sharing L3 and the directory, writing through."""
    from controlplane.directory.services import modelprofile_ensure

    def build() -> tuple[Engine, Engine]:
        model = models("tiny")
        pair = []
        for node in NODES[:2]:
            engine = engine_for(model, stores(layout_for(model)), write_back_tier="host")
            engine.node, engine.directory = node, directory
            engine.offload.apply_policies(classes=WRITE_THROUGH)
            modelprofile_ensure(profile=engine.profile)
            pair.append(engine)
        return pair[0], pair[1]

    return build


def test_the_engine_recomputes_a_forged_l3_block_and_quarantines_it(engines, directory):
    a, b = engines()
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(3 * BLOCK_TOKENS + 4)]
    cold = a.generate(prompt, max_tokens=4)
    assert directory.flush(timeout=10)
    keys = [fp.prefix_key for fp in a.offload.fingerprints(prompt, "default")]
    remote = a.store.tier("remote")
    assert all(remote.contains(key) for key in keys)

    # Node a rewrites block 1 in L3 with the bytes of another block (a valid value for them).
    other = layout_for(a.model).empty()
    remote.get(keys[2], other)
    remote.put(keys[1], other)

    served = b.generate(prompt, max_tokens=4, write_back=False)
    assert served.output_ids == cold.output_ids  # recomputed from block 1, never served
    assert served.trace.load_failures == 1 and served.trace.cached_tokens == BLOCK_TOKENS
    assert b.counters.get("remote_unverified") == 1 and b.counters.get("quarantined") == 1
    assert directory.flush(timeout=10)
    assert registered(keys[1])["remote"][1] == "corrupt" and not remote.contains(keys[1])
    assert registered(keys[0])["remote"][1] == "ready"
    again = b.generate(prompt, max_tokens=4, write_back=False)
    assert again.trace.load_failures == 0 and again.trace.cached_tokens == BLOCK_TOKENS
    assert again.output_ids == cold.output_ids
