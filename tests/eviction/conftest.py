"""The engine tests' fixtures (tiny models, real tiered stores), and an offload manager over a store."""

from __future__ import annotations

from tests.engine.conftest import make_store, models, redis_url  # noqa: F401 - fixtures
