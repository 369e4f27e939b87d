"""A copy that fails its checksum while the engine loads it is never served, and the directory
marks it corrupt at once (I2), so no node is sent to it again (real PostgreSQL, real disk tier)."""

from __future__ import annotations

import os
import random

import pytest

from tests.engine.conftest import BLOCK_TOKENS, engine_for, make_store, redis_url  # noqa: F401 - fixtures
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


def test_a_corrupt_disk_copy_is_recomputed_and_quarantined(models, make_store, directory):  # noqa: F811
    from controlplane.directory.models import Placement
    from controlplane.directory.services import (
        TierReport,
        modelprofile_ensure,
        namespace_ensure,
        node_heartbeat,
    )

    model = models("tiny")
    store = make_store(model, ("disk",))
    engine = engine_for(model, store, write_back_tier="disk")
    engine.node, engine.directory = "gpu-q", directory
    node_heartbeat(
        name="gpu-q",
        host="h",
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier="disk", capacity_bytes=1 << 30, used_bytes=0)],
    )
    modelprofile_ensure(profile=engine.profile)
    namespace_ensure(name="default")
    rng = random.Random(3)
    prompt = [rng.randrange(1, 250) for _ in range(3 * BLOCK_TOKENS + 5)]
    cold = engine.generate(prompt, max_tokens=4)
    assert directory.flush(timeout=10)
    assert Placement.objects.filter(tier="disk", state="ready").count() == 3

    first = engine.fingerprinter("default").blocks(prompt)[0].prefix_key
    path = store.tier("disk").path_of(first)
    with open(path, "r+b") as f:  # one flipped bit in the last layer's bytes
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(os.path.getsize(path) - 100)
        f.write(bytes([byte[0] ^ 0x01]))

    def states() -> dict[object, str]:
        assert directory.flush(timeout=10)
        return {p.block.prefix_key: p.state for p in Placement.objects.select_related("block").filter(tier="disk")}

    again = engine.generate(prompt, max_tokens=4, write_back=False)
    assert again.output_ids == cold.output_ids  # recomputed, never served from the damaged copy
    assert again.trace.load_failures == 1 and again.trace.cached_tokens == 0
    assert states()[first] == "corrupt"
    assert sorted(states().values()) == ["corrupt", "ready", "ready"]
    assert engine.counters.get("quarantined") == 1
    # The next request writes the block back with good bytes: servable again, and served.
    engine.generate(prompt, max_tokens=4)
    assert sorted(states().values()) == ["ready", "ready", "ready"]
    warm = engine.generate(prompt, max_tokens=4)
    assert warm.output_ids == cold.output_ids and warm.trace.cached_tokens == 3 * BLOCK_TOKENS
