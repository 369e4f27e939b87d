"""TieredStore across real tiers, and the factory that builds it from the node options."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.config import ConfigError, load_config
from worker.dataplane.errors import BlockMissing, TierFull, TierUnavailable
from worker.dataplane.hashing import model_key
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.store import LEVEL_MEDIUMS, TieredStore, build_store
from worker.dataplane.tier_names import TIER_ORDER
from worker.dataplane.tiers.remote import RemoteTier

PROFILE = ModelProfile(model_id="test/small", dtype="bf16", **SMALL)
LAYOUT = block_layout(PROFILE)


@pytest.fixture
def node_config(tmp_path, shm_name, redis_server):
    def make(**overrides):
        values = {
            "node_name": "node-a",
            "device_bytes": "8MiB",
            "host_bytes": "8MiB",
            "disk_bytes": "16MiB",
            "disk_path": str(tmp_path / "{node}" / "disk"),
            "remote_bytes": "64MiB",
            "remote_url": redis_server.url,
            "remote_prefix": "t",
            "host_pool_name": shm_name,
        }
        values.update(overrides)
        return load_config(overrides=values, environ={})

    return make


@pytest.fixture
def store(node_config):
    built = build_store(node_config(), profile=PROFILE)
    yield built
    built.close()


def test_factory_builds_every_tier_from_the_options(store, node_config, tmp_path) -> None:
    assert store.names == ("device", "host", "disk", "remote")
    usage = store.usage()
    assert usage["device"].capacity_bytes == 8 * 1024 * 1024
    assert usage["host"].capacity_bytes == 4 * LAYOUT.block_bytes
    assert usage["disk"].capacity_bytes == 16 * 1024 * 1024
    assert isinstance(store.tier("remote"), RemoteTier)
    assert (tmp_path / "node-a" / "disk").is_dir()
    pool = Path("/dev/shm", f"{node_config().node_host_pool_name}-{model_key(PROFILE).hex[:12]}")
    assert pool.exists()


def test_get_takes_the_fastest_tier_and_reports_it(store) -> None:
    blocks = {n: torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8) for n in range(4)}
    for n, tier in enumerate(store.names):
        store.put(key(n), blocks[n], tier=tier)
    store.put(key(3), blocks[3], tier="disk")  # also in a faster tier than remote
    for n, tier in enumerate(("device", "host", "disk", "disk")):
        result = store.get(key(n))
        assert result.tier == tier and torch.equal(result.data, blocks[n])
    assert store.get(key(3), tiers=["remote"]).tier == "remote"
    assert store.locate([key(3), key(9)]) == {key(3): ("disk", "remote"), key(9): ()}
    with pytest.raises(BlockMissing):
        store.get(key(9))
    stats = store.stats()
    assert stats["store.hits.disk"] == 2 and stats["store.misses"] == 1


def test_layerwise_reads_across_tiers(store) -> None:
    blocks = {n: torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8) for n in range(5)}
    for n, tier in enumerate(("device", "host", "disk", "remote")):
        store.put(key(n), blocks[n], tier=tier)
    keys = [key(n) for n in range(5)]  # key 4 is nowhere
    for layer in range(LAYOUT.layers):
        outs = [LAYOUT.empty(layers=1) for _ in keys]
        futures = store.get_layers(keys, layers=layer, outs=outs)
        served = [f.result(timeout=30).tier for f in futures[:4]]
        assert served == ["device", "host", "disk", "remote"]
        with pytest.raises(BlockMissing):
            futures[4].result(timeout=30)
        offset, nbytes = LAYOUT.span(layer)
        for n in range(4):
            assert torch.equal(outs[n], blocks[n][offset : offset + nbytes])


def test_copy_moves_a_block_down_with_its_verified_checksum(store) -> None:
    block = torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8)
    put = store.put(key(1), block, tier="host")
    copied = store.copy(key(1), source="host", target="disk")
    assert copied.checksum == put.checksum
    assert store.copy(key(1), source="disk", target="remote").checksum == put.checksum
    assert store.tier("remote").checksum(key(1)) == put.checksum
    assert store.delete(key(1)) == ("host", "disk", "remote")
    assert store.locate([key(1)]) == {key(1): ()}


def test_every_tier_level_has_a_medium() -> None:
    assert tuple(LEVEL_MEDIUMS) == TIER_ORDER


def test_puts_are_refused_when_a_tier_is_full(store) -> None:
    block = torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8)
    for n in range(4):
        store.put(key(n), block, tier="device")
    with pytest.raises(TierFull):
        store.put(key(9), block, tier="device")
    assert store.usage()["device"].blocks == 4
    assert store.put_async(key(9), block, tier="host").result(timeout=30).tier == "host"


def test_factory_fails_loudly(node_config, redis_server) -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        build_store(node_config(remote_url=""), profile=PROFILE, environ={})
    redis_server.stop()
    config = node_config(tiers="disk,remote")
    with pytest.raises(TierUnavailable):
        build_store(config, profile=PROFILE)


def test_factory_takes_redis_url_and_tier_selection(node_config, redis_server) -> None:
    config = node_config(remote_url="", tiers="disk,remote")
    with build_store(config, profile=PROFILE, environ={"REDIS_URL": redis_server.url}) as built:
        assert built.names == ("disk", "remote")


def test_stores_of_two_processes_share_the_node_tiers(store, node_config) -> None:
    """A second store (as the node's Celery worker would build) sees the hasher's host and disk blocks."""
    block = torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8)
    store.put(key(1), block, tier="host")
    store.put(key(2), block, tier="disk")
    with build_store(node_config(tiers="host,disk"), profile=PROFILE) as other:
        assert other.get(key(1)).tier == "host"
        assert other.get(key(2)).tier == "disk"
        other.delete(key(2))
    assert store.locate([key(2)]) == {key(2): ()}


def test_store_validates_its_tiers(open_tier) -> None:
    small = open_tier("device", LAYOUT, blocks=1)
    other = open_tier(
        "device",
        layout_of({"layers": 2, "kv_heads": 1, "head_dim": 8, "block_tokens": 4}),
        blocks=1,
    )
    with pytest.raises(ValueError, match="another layout"):
        TieredStore(layout=LAYOUT, tiers=[other])
    with pytest.raises(ValueError, match="unique"):
        TieredStore(layout=LAYOUT, tiers=[small, small])
    store = TieredStore(layout=LAYOUT, tiers=[small])
    with pytest.raises(KeyError, match="no tier"):
        store.put(uuid.uuid4(), torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8), tier="host")
