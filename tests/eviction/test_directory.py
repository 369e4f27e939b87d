"""Blocks a full host tier evicts at write-back leave the directory with the next batch (real
PostgreSQL directory, real shared-memory tier, the tiny model's engine)."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from worker.postgres_directory import DirectoryOptions, PostgresDirectory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def directory():
    client = PostgresDirectory(
        options=DirectoryOptions(flush_interval_s=0.02, batch_size=500, lookup_timeout_ms=5000),
        announce=lambda **_: None,
    )
    yield client
    client.close()


def test_evicted_copies_leave_the_directory_and_the_hot_prompt_stays(models, make_store, directory):
    from controlplane.directory.models import Placement
    from controlplane.directory.services import TierReport, modelprofile_ensure, namespace_ensure, node_heartbeat

    model = models("tiny")
    store = make_store(model, ("host",), blocks=6)
    engine = engine_for(model, store, write_back_tier="host")
    engine.node, engine.directory = "gpu-e", directory
    node_heartbeat(
        name="gpu-e",
        host="h",
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier="host", capacity_bytes=1 << 30, used_bytes=0)],
    )
    modelprofile_ensure(profile=engine.profile)
    namespace_ensure(name="default")
    rng = random.Random(7)
    hot = [rng.randrange(1, 250) for _ in range(2 * BLOCK_TOKENS + 1)]
    engine.generate(hot, max_tokens=1)
    for _ in range(6):  # 6 prompts of 2 blocks each: 12 new blocks into the 4 slots left
        engine.generate(hot, max_tokens=1)  # the hot prompt is reused before each
        engine.generate([rng.randrange(1, 250) for _ in range(2 * BLOCK_TOKENS + 1)], max_tokens=1)
    engine.generate(hot, max_tokens=1)  # the batch after the last evictions
    assert directory.flush(timeout=10)
    evicted = engine.counters.get("eviction.host.pressure")
    assert evicted == 2 + 12 - 6
    on_host = set(Placement.objects.filter(tier="host", node__name="gpu-e").values_list("block__prefix_key", flat=True))
    assert on_host == set(store.tier("host").keys())
    hot_keys = {fp.prefix_key for fp in engine.fingerprinter("default").blocks(hot)}
    assert hot_keys <= on_host
    again = engine.generate(hot, max_tokens=1, write_back=False)
    assert again.trace.hit_blocks_by_tier == {"host": 2}
