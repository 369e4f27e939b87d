"""Fixtures for the blend tests: tiny random models for the mechanics, the trained fixture model for quality."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.engine.engine import Engine, EngineOptions
from worker.dataplane.layout import BlockLayout
from worker.dataplane.models.loading import LoadedModel, load_model
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.device import DeviceTier

BLOCK_TOKENS = 16
FIXTURE_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "blend-model"
MULTIHOP_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "blend-multihop"


@pytest.fixture(scope="session")
def models() -> Callable[..., LoadedModel]:
    cache: dict[tuple[str, str], LoadedModel] = {}

    def get(name: str, dtype: str = "float32") -> LoadedModel:
        if (name, dtype) not in cache:
            cache[(name, dtype)] = load_model(name, dtype=dtype, device="cpu")
        return cache[(name, dtype)]

    return get


def blend_engine(
    model: LoadedModel, *, blocks: int = 512, tiers: tuple[str, ...] = ("device",), **blend: object
) -> Engine:
    """An engine with fragment reuse on, over an in-memory pool (real DeviceTier on CPU)."""
    layout = BlockLayout(
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        block_tokens=BLOCK_TOKENS,
        dtype=model.dtype,
    )
    store = TieredStore(layout=layout, tiers=[DeviceTier(layout=layout, capacity_bytes=blocks * layout.block_bytes)])
    settings: dict[str, object] = {"enabled": True, "sample_rate": 0.0}
    settings.update(blend)
    return Engine(
        model=model,
        store=store,
        options=EngineOptions(
            block_tokens=BLOCK_TOKENS,
            write_back_tier="device",
            keep_in_device=False,
            decide=False,
            blend=BlendOptions(**settings),
        ),
    )  # type: ignore[arg-type]


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(count)]
