"""Suite `eviction`: what a full host tier keeps when write-back evicts by the tier's policy,
against a tier that refuses the new block when full ("old drop": no local eviction).

Both workloads run on a real shared-memory host tier of 64 blocks (times --scale), written
through the offload manager's `store_block` (the engine's write-back path), with a manual clock
(one tick per request) so that runs differ only by their seed:

* ``burst_3x``: 8 hot two-block prompts (2 of their blocks pinned) are stored, then a burst of
  three times the pool in new four-block prompts, one hot prompt reused before each.
  ``kept_share``: the burst's blocks stored; ``hot_kept_share``: the hot blocks still held at the
  end (LRU).
* ``mixed``: 400 requests (times --scale), 70% a reuse of one of 24 four-block prompts (Zipf
  weights: 96 blocks, more than the pool), 30% a one-off prompt; before each write-back the
  request's leading run of held blocks counts as hits and is touched. ``hit_share`` per algorithm
  (lru, lfu, s3fifo, cost-aware) and for the old drop.

Each row is the median over --repeats runs (5 at least, seeds 0..n-1); its note gives the spread
(min..max).
"""

from __future__ import annotations

import os
import random
import statistics
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import Context, Row
from worker.dataplane.errors import TierFull
from worker.dataplane.eviction.rules import ALGORITHMS, parse_rules
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Hit
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.host import HostTier

DESCRIPTION = "share of a 3x burst a full host tier keeps, and reuse hits per eviction policy, vs. dropping"
EXPECTED_ROWS = (
    "eviction.burst_3x.kept_share",
    "eviction.burst_3x.kept_share.old_drop",
    *(f"eviction.mixed.{algorithm}.hit_share" for algorithm in ALGORITHMS),
    "eviction.mixed.old_drop.hit_share",
)
"""The burst and the mixed workload, under each eviction algorithm and dropping the new block."""
PROFILE = ModelProfile(model_id="bench-eviction", layers=2, kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
POOL_BLOCKS = 64
REQUESTS = 400
RUNS = 5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A host tier of `blocks` blocks and, unless `drop`, an offload manager evicting by `algorithm`."""

    def __init__(self, blocks: int, *, algorithm: str = "lru", drop: bool = False) -> None:
        layout = block_layout(PROFILE)
        self.name = f"strata-bench-evict-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tier = HostTier(layout=layout, capacity_bytes=blocks * layout.block_bytes, pool_name=self.name)
        self.store = TieredStore(layout=layout, tiers=[tier])
        self.clock = Clock()
        self.manager = OffloadManager(store=self.store, profile=PROFILE, clock=self.clock)
        self.manager.apply_rules(parse_rules(tiers=[{"tier": "host", "algorithm": algorithm}]))
        self.drop = drop
        self.data = layout.empty()

    def close(self) -> None:
        self.store.close()
        (Path("/dev/shm") / self.name).unlink(missing_ok=True)

    def held(self, keys: list[uuid.UUID]) -> list[bool]:
        return self.store.tier("host").contains_many(keys)

    def request(self, keys: list[uuid.UUID]) -> int:
        """One request: its leading run of held blocks is hit (and touched), the rest written back."""
        self.clock.now += 1
        present = self.held(keys)
        hits = next((i for i, here in enumerate(present) if not here), len(keys))
        if hits:
            self.manager.note_hits([Hit(index=i, key=k, tier="host") for i, k in enumerate(keys[:hits])])
        self.write(keys[hits:], start=hits)
        return hits

    def write(self, keys: list[uuid.UUID], *, start: int = 0) -> int:
        stored = 0
        registrations = []
        for i, key in enumerate(keys):
            if self.drop:
                try:
                    self.store.put(key, self.data, tier="host")
                    stored += 1
                except TierFull:
                    pass
                continue
            reg = self.manager.store_block(
                key=key, content_key=key, position=(start + i) * 16, namespace="a", data=self.data
            )
            if reg is not None:
                stored += 1
                registrations.append(reg)
        self.manager.register(registrations)
        return stored


def prompt(rng: random.Random, blocks: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=rng.getrandbits(128)) for _ in range(blocks)]


def burst(seed: int, pool_blocks: int, *, drop: bool) -> tuple[float, float]:
    rng = random.Random(seed)
    pool = Pool(pool_blocks, drop=drop)
    try:
        hot = [prompt(rng, 2) for _ in range(8)]
        for keys in hot:
            pool.write(keys)
        pool.manager.evictor.ledger.pin([hot[0][0], hot[1][0]])
        stored = total = 0
        while total < 3 * pool_blocks:
            pool.request(rng.choice(hot))
            pool.clock.now += 1
            new = prompt(rng, 4)
            stored += pool.write(new)
            total += len(new)
        flat = [key for keys in hot for key in keys]
        return stored / total, sum(pool.held(flat)) / len(flat)
    finally:
        pool.close()


def mixed(seed: int, pool_blocks: int, requests: int, *, algorithm: str = "lru", drop: bool = False) -> float:
    rng = random.Random(seed)
    pool = Pool(pool_blocks, algorithm=algorithm, drop=drop)
    try:
        popular = [prompt(rng, 4) for _ in range(24)]
        weights = [1 / (rank + 1) for rank in range(len(popular))]
        hits = blocks = 0
        for _ in range(requests):
            keys = rng.choices(popular, weights)[0] if rng.random() < 0.7 else prompt(rng, 4)
            hits += pool.request(keys)
            blocks += len(keys)
        return hits / blocks
    finally:
        pool.close()


def summary(name: str, values: list[float], unit: str = "share", baseline: str | None = None) -> Row:
    return Row(
        name=name,
        value=round(statistics.median(values), 4),
        unit=unit,
        baseline=baseline,
        note=f"median of {len(values)} runs, spread {min(values):.3f}..{max(values):.3f}",
    )


def run(ctx: Context) -> list[Row]:
    torch.manual_seed(0)
    runs = max(RUNS, ctx.repeats)
    pool_blocks = max(16, int(POOL_BLOCKS * ctx.scale))
    requests = max(100, int(REQUESTS * ctx.scale))
    ctx.params.update(pool_blocks=pool_blocks, requests=requests, runs=runs)
    ctx.plan(2 + len(ALGORITHMS) + 1)
    rows: list[Row] = []
    seeds = range(runs)

    def each(measure: Callable[[int], float]) -> list[float]:
        return [measure(seed) for seed in seeds]

    ours = [burst(seed, pool_blocks, drop=False) for seed in seeds]
    ctx.step("burst, evicting")
    old = [burst(seed, pool_blocks, drop=True) for seed in seeds]
    ctx.step("burst, dropping")
    rows += [
        summary("eviction.burst_3x.kept_share", [kept for kept, _ in ours]),
        summary("eviction.burst_3x.kept_share.old_drop", [kept for kept, _ in old]),
        summary("eviction.burst_3x.hot_kept_share", [hot for _, hot in ours]),
        summary("eviction.burst_3x.hot_kept_share.old_drop", [hot for _, hot in old]),
    ]
    for algorithm in ALGORITHMS:
        values = each(lambda seed, a=algorithm: mixed(seed, pool_blocks, requests, algorithm=a))  # type: ignore[misc]
        rows.append(summary(f"eviction.mixed.{algorithm}.hit_share", values))
        ctx.step(f"mixed, {algorithm}")
    rows.append(
        summary("eviction.mixed.old_drop.hit_share", each(lambda seed: mixed(seed, pool_blocks, requests, drop=True)))
    )
    ctx.step("mixed, dropping")
    return rows
