"""Fragments found through the directory: a node with an empty local index finds, by content key,
blocks another node stored in the shared remote tier (real PostgreSQL and Redis)."""

from __future__ import annotations

import pytest

from tests.blend.conftest import BLOCK_TOKENS, tokens
from tests.engine.conftest import make_store, redis_url  # noqa: F401 - fixtures
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.engine.engine import Engine, EngineOptions
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


def remote_engine(model, store, directory, node: str) -> Engine:
    return Engine(
        model=model,
        store=store,
        node=node,
        directory=directory,
        options=EngineOptions(
            block_tokens=BLOCK_TOKENS,
            write_back_tier="remote",
            keep_in_device=False,
            decide=False,
            blend=BlendOptions(enabled=True, recompute_percent=20, sample_rate=0.0),
        ),
    )


def test_a_fresh_node_finds_fragments_by_content_key(models, make_store, directory):  # noqa: F811
    from controlplane.directory.services import modelprofile_ensure, namespace_ensure

    model = models("tiny")
    store = make_store(model, ("remote",))
    writer = remote_engine(model, store, directory, "gpu-a")
    modelprofile_ensure(profile=writer.profile)
    namespace_ensure(name="default")
    passage = tokens(3 * BLOCK_TOKENS, seed=1)
    writer.generate([1, *tokens(12, seed=2), *passage, 4], max_tokens=1, segments=[[13, 13 + len(passage)]])
    assert directory.flush(timeout=10)

    reader = remote_engine(model, store, directory, "gpu-b")  # nothing in its own index
    prompt = [1, *tokens(37, seed=3), *passage, *tokens(5, seed=4)]
    result = reader.generate(prompt, max_tokens=3)
    assert result.trace.fragment_tokens == len(passage)
    assert result.trace.fragment_blocks_by_tier == {"remote": 3}
    assert result.trace.recomputed_tokens == round(0.2 * len(passage) + 0.5)
    # Another fresh node: prefix reuse alone never serves the passage; fragment reuse finds it.
    assert directory.flush(timeout=10)
    third = remote_engine(model, store, directory, "gpu-c")
    assert third.generate(prompt, max_tokens=1, blend=False).trace.fragment_tokens == 0
    assert third.generate(prompt, max_tokens=1).trace.fragment_tokens == len(passage)
