"""Fixtures for the engine tests: tiny models and real tiered stores (shared memory, files, Redis)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from controlplane.runtime.environment import load_environment
from worker.dataplane.engine.engine import Engine, EngineOptions
from worker.dataplane.layout import BlockLayout
from worker.dataplane.models.loading import LoadedModel, load_model
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier

BLOCK_TOKENS = 16


def layout_for(model: LoadedModel, block_tokens: int = BLOCK_TOKENS) -> BlockLayout:
    return BlockLayout(
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        block_tokens=block_tokens,
        dtype=model.dtype,
    )


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test session's Redis (embedded unless REDIS_URL is set), used as the L3 store."""
    return load_environment().redis.url_for_db(5)


@pytest.fixture
def make_store(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., TieredStore]]:
    """Build a store of the given tiers for a model; every store and its bytes go away after the test."""
    stores: list[TieredStore] = []
    pools: list[Path] = []
    prefixes: list[str] = []

    def build(model: LoadedModel, tiers: tuple[str, ...], *, blocks: int = 64) -> TieredStore:
        layout = layout_for(model)
        capacity = blocks * layout.block_bytes
        built = []
        for name in tiers:
            if name == "device":
                built.append(DeviceTier(layout=layout, capacity_bytes=capacity))
            elif name == "host":
                pool = f"strata-enginetest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                pools.append(Path("/dev/shm") / pool)
                built.append(HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool))
            elif name == "disk":
                built.append(DiskTier(layout=layout, capacity_bytes=capacity, path=tmp_path / f"disk-{len(stores)}"))
            elif name == "remote":
                prefix = f"strata-enginetest-{uuid.uuid4().hex[:8]}"
                prefixes.append(prefix)
                client = redis.Redis.from_url(redis_url, socket_timeout=5)
                built.append(RemoteTier(layout=layout, capacity_bytes=capacity, client=client, prefix=prefix))
        store = TieredStore(layout=layout, tiers=built)
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.close()
    for pool in pools:
        pool.unlink(missing_ok=True)
    if prefixes:
        client = redis.Redis.from_url(redis_url)
        for prefix in prefixes:
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
        client.close()


@pytest.fixture(scope="session")
def models() -> Callable[[str, str], LoadedModel]:
    cache: dict[tuple[str, str], LoadedModel] = {}

    def get(name: str, dtype: str = "float32") -> LoadedModel:
        if (name, dtype) not in cache:
            cache[(name, dtype)] = load_model(name, dtype=dtype)
        return cache[(name, dtype)]

    return get


def engine_for(model: LoadedModel, store: TieredStore, **options: object) -> Engine:
    defaults: dict[str, object] = {"block_tokens": BLOCK_TOKENS, "keep_in_device": False, "decide": False}
    defaults.update(options)
    if "write_back_tier" not in options:
        defaults["write_back_tier"] = store.names[0]
    return Engine(model=model, store=store, options=EngineOptions(**defaults))  # type: ignore[arg-type]
