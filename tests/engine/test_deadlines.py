"""Deadlines on the serving path, over real PostgreSQL and Redis behind a path that blackholes
(`tests.support.BlackholeProxy`: bytes stop flowing both ways, no connection is closed).

With the directory's path blackholed, a request's lookup is a miss by its deadline and serving
goes on; the blocks written back meanwhile are kept, and registered once the path returns. With
L3's path blackholed, a load from L3 is given up at the load deadline and the request recomputes
(the same answer), and the requests after it fail fast while the tier stays silent.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from controlplane.runtime.environment import load_environment
from tests.engine.conftest import BLOCK_TOKENS, engine_for, layout_for
from tests.support import BlackholeProxy, directory_client, postgres_socket, wait_for
from worker.dataplane.directory import DirectoryUnavailable
from worker.dataplane.engine.engine import Engine
from worker.dataplane.models.loading import LoadedModel
from worker.dataplane.network import ConnectionOptions
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier, redis_client
from worker.postgres_directory import PostgresDirectory

pytestmark = pytest.mark.django_db(transaction=True)

WRITE_THROUGH = [{"name": "default", "namespaces": [], "remote_write": "write-through"}]
LOOKUP_DEADLINE_S = 0.5
LOAD_DEADLINE_S = 0.5


@pytest.fixture
def nodes() -> None:
    from controlplane.directory.services import TierReport, namespace_ensure, node_heartbeat

    for name in ("gpu-a", "gpu-b"):
        node_heartbeat(
            name=name,
            host="h",
            heartbeat_seconds=5.0,
            tiers=[TierReport(tier="host", capacity_bytes=1 << 30, used_bytes=0)],
        )
    namespace_ensure(name="default")


@pytest.fixture
def proxy() -> Iterator[Callable[[Path], BlackholeProxy]]:
    made: list[BlackholeProxy] = []

    def build(upstream: Path) -> BlackholeProxy:
        made.append(BlackholeProxy(upstream))
        return made[-1]

    yield build
    for each in made:
        each.close()


@pytest.fixture
def stores() -> Iterator[Callable[..., TieredStore]]:
    """Stores of host and L3 tiers, all under one L3 prefix; `remote_url` picks the L3 path."""
    prefix = f"strata-deadlines-{uuid.uuid4().hex[:8]}"
    built: list[TieredStore] = []
    pools: list[Path] = []

    def build(model: LoadedModel, remote_url: str) -> TieredStore:
        layout = layout_for(model)
        pool = f"strata-deadlines-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pools.append(Path("/dev/shm") / pool)
        capacity = 64 * layout.block_bytes
        client = redis_client(remote_url, timeout_s=2.0, connection=ConnectionOptions(health_check_s=1))
        store = TieredStore(
            layout=layout,
            tiers=[
                HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
                RemoteTier(layout=layout, capacity_bytes=capacity, client=client, prefix=prefix),
            ],
        )
        built.append(store)
        return store

    yield build
    for store in built:
        store.close()
    for pool in pools:
        pool.unlink(missing_ok=True)
    client = redis.Redis.from_url(load_environment().redis.url_for_db(5))
    for name in client.scan_iter(f"{prefix}*"):
        client.delete(name)
    client.close()


def engine_of(model: LoadedModel, store: TieredStore, node: str, directory: PostgresDirectory) -> Engine:
    from controlplane.directory.services import modelprofile_ensure

    engine = engine_for(
        model,
        store,
        write_back_tier="host",
        lookup_deadline_s=LOOKUP_DEADLINE_S,
        load_deadline_s=LOAD_DEADLINE_S,
    )
    engine.node, engine.directory = node, directory
    modelprofile_ensure(profile=engine.profile)
    return engine


def prompt_of(seed: int, blocks: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(blocks * BLOCK_TOKENS + 4)]


def placements(keys: list[uuid.UUID]) -> int:
    from controlplane.directory.models import Placement

    return Placement.objects.filter(block__prefix_key__in=keys).count()


def test_a_blackholed_directory_is_a_miss_by_the_deadline_and_writes_wait_for_the_path(models, stores, nodes, proxy):
    pg = proxy(postgres_socket())
    # Reads cut at 1.5 s: past the request's 0.5 s, so that the request's own deadline shows.
    directory = directory_client(
        pg.port, read_deadline_s=1.5, unavailable_s=0.2, write_timeout_ms=200, write_grace_s=0.5, retry_max_s=0.3
    )
    try:
        model = models("tiny")
        engine = engine_of(model, stores(model, load_environment().redis.url_for_db(5)), "gpu-a", directory)
        warm = engine.generate(prompt_of(1), max_tokens=2)
        assert directory.flush(timeout=10) and warm.trace.cached_tokens == 0

        pg.blackhole()
        began = time.perf_counter()
        cold = engine.generate(prompt_of(2), max_tokens=2)  # its lookup waits on the directory
        first = time.perf_counter() - began
        wait_for(lambda: directory.stats().read_deadlines == 1, timeout=5, what="the lookup's read cut")
        later = []
        for seed in (3, 4):
            began = time.perf_counter()
            engine.generate(prompt_of(seed), max_tokens=2)
            later.append(time.perf_counter() - began)
        hit = engine.generate(prompt_of(1), max_tokens=2)  # this node's own blocks need no directory
        print(f"blackholed: first request {first:.3f} s (lookup {cold.trace.lookup_s:.3f} s), later {later}")
        assert cold.trace.lookup_s < LOOKUP_DEADLINE_S + 0.3, cold.trace.lookup_s
        assert engine.counters.get("lookup_deadlines") == 1
        assert max(later) < 1.0, later  # the directory is known down: lookups fail at once
        assert hit.trace.cached_tokens == 3 * BLOCK_TOKENS and hit.output_ids == warm.output_ids
        saved = [fp.prefix_key for seed in (2, 3, 4) for fp in engine.offload.fingerprints(prompt_of(seed), "default")]
        assert all(engine.store.tier("host").contains_many(saved))  # kept while the directory is away
        wait_for(lambda: directory.stats().write_deadlines >= 1, timeout=10, what="a write cut at its deadline")
        assert placements(saved) == 0

        pg.restore()
        assert directory.flush(timeout=20), directory.stats()
        assert placements(saved) == len(saved)
        stats = directory.stats()
        print(stats)
        assert stats.read_deadlines == 1 and stats.write_deadlines >= 1 and stats.rejected == 0
        keys = [fp.prefix_key for fp in engine.offload.fingerprints(prompt_of(3), "default")]

        def found() -> int:
            try:
                answer = directory.lookup(keys=keys, node="gpu-a", namespace="default", model_key=engine.model_key)
            except DirectoryUnavailable:
                return 0  # the probe has not reached the database again yet
            return answer.prefix_hit_blocks

        assert wait_for(found, timeout=5, what="lookups answered once the path is back") == 3
    finally:
        directory.close(timeout=5)


def test_a_blackholed_l3_load_is_given_up_by_the_deadline_and_recomputed(models, stores, nodes, proxy):
    env = load_environment()
    l3 = proxy(Path(env.redis.socket_path))
    directory = directory_client(None, read_deadline_s=5.0)
    try:
        model = models("tiny")
        writer = engine_of(model, stores(model, env.redis.url_for_db(5)), "gpu-a", directory)
        writer.offload.apply_policies(classes=WRITE_THROUGH)
        reader = engine_of(model, stores(model, f"redis://127.0.0.1:{l3.port}/5"), "gpu-b", directory)
        prompts = [prompt_of(seed) for seed in (11, 12, 13)]
        colds = [writer.generate(prompt, max_tokens=3) for prompt in prompts]
        assert directory.flush(timeout=10)

        l3.blackhole()
        served, took = [], []
        for prompt in prompts[:2]:
            began = time.perf_counter()
            served.append(reader.generate(prompt, max_tokens=3, write_back=False))
            took.append(time.perf_counter() - began)
        print(f"blackholed L3: requests took {took}")
        assert [s.output_ids for s in served] == [c.output_ids for c in colds[:2]]  # recomputed, the same tokens
        assert all(s.trace.cached_tokens == 0 and s.trace.load_failures == 1 for s in served)
        assert reader.counters.get("load_deadlines") >= 1
        assert max(took) < LOAD_DEADLINE_S + 1.0, took
        # Once a read has timed out (the 2 s socket timeout) the tier is not waited on again for a while.
        wait_for(lambda: reader.store.stats().get("remote.unavailable", 0) > 0, timeout=10, what="L3 timing out")
        began = time.perf_counter()
        fast = reader.generate(prompts[2], max_tokens=3, write_back=False)
        assert time.perf_counter() - began < LOAD_DEADLINE_S, "a silent L3 is not waited on again at once"
        assert fast.output_ids == colds[2].output_ids and fast.trace.cached_tokens == 0

        l3.restore()
        remote = reader.store.tier("remote")
        assert isinstance(remote, RemoteTier)
        time.sleep(remote.retry_after_s)

        def loads_from_l3() -> bool:
            again = reader.generate(prompts[0], max_tokens=3, write_back=False)
            assert again.output_ids == colds[0].output_ids
            return again.trace.cached_tokens == 3 * BLOCK_TOKENS

        wait_for(loads_from_l3, timeout=10, what="loads from L3 once its path is back")
    finally:
        directory.close(timeout=5)
