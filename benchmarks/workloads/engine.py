"""The serving workloads on Strata's engine in this process, for the `engine` and `fleet` suites:
multi-turn chat over a shared system prompt and long-document QA, each under four cache setups
(no cache, the device alone, device + host, device + disk), sent through worker.workload's driver
(`engine_send`), with their rows and their ratios to no cache; and what the engine suites share to
build them (the block layout of a model, scratch tiers of every kind, reproducible prompts)."""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from benchmarks.harness import Row
from benchmarks.workloads.sessions import TokenStep
from worker.dataplane.engine.engine import Engine, EngineOptions
from worker.dataplane.layout import BlockLayout
from worker.dataplane.models.loading import LoadedModel, load_model
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import Tier
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier
from worker.workload import Outcome, Send, drive

BLOCK_TOKENS = 256


def block_layout(model: LoadedModel) -> BlockLayout:
    return BlockLayout(
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        block_tokens=BLOCK_TOKENS,
        dtype=model.dtype,
    )


@contextmanager
def scratch_tiers(model: LoadedModel, *, blocks: int, redis_url: str, workdir: Path) -> Iterator[dict[str, Tier]]:
    """One tier of each kind, each big enough for `blocks` blocks; everything removed afterwards."""
    layout = block_layout(model)
    capacity = blocks * layout.block_bytes
    pool = f"strata-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    prefix = f"strata-bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    tiers: dict[str, Tier] = {
        "device": DeviceTier(layout=layout, capacity_bytes=capacity),
        "host": HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
        "disk": DiskTier(layout=layout, capacity_bytes=capacity, path=workdir / "disk"),
        "remote": RemoteTier(layout=layout, capacity_bytes=capacity, client=client, prefix=prefix),
    }
    try:
        yield tiers
    finally:
        for tier in tiers.values():
            tier.close()
        Path("/dev/shm", pool).unlink(missing_ok=True)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def random_prompt(tokens: int, seed: int) -> list[int]:
    """A prompt of `tokens` byte-tokenizer ids, BOS first, reproducible from `seed`."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(tokens - 1)]


CONFIGS = ("no_cache", "device_only", "strata_host", "strata_disk")


def _engine_for(config: str, model: LoadedModel, tiers: dict[str, Tier], device_blocks: int) -> Engine:
    layout = block_layout(model)
    # A small device pool, as GPU memory would be next to long contexts.
    device = DeviceTier(layout=layout, capacity_bytes=device_blocks * layout.block_bytes)
    if config == "no_cache":
        store, options = (
            TieredStore(layout=layout, tiers=[device]),
            EngineOptions(block_tokens=BLOCK_TOKENS, write_back_tier="device", keep_in_device=False, decide=False),
        )
    elif config == "device_only":
        store, options = (
            TieredStore(layout=layout, tiers=[device]),
            EngineOptions(block_tokens=BLOCK_TOKENS, write_back_tier="device", keep_in_device=True, decide=False),
        )
    elif config == "strata_host":
        store, options = (
            TieredStore(layout=layout, tiers=[device, tiers["host"]]),
            EngineOptions(block_tokens=BLOCK_TOKENS, write_back_tier="host", keep_in_device=True, decide=False),
        )
    else:
        store, options = (
            TieredStore(layout=layout, tiers=[device, tiers["disk"]]),
            EngineOptions(block_tokens=BLOCK_TOKENS, write_back_tier="disk", keep_in_device=True, decide=False),
        )
    return Engine(model=model, store=store, options=options)


def engine_send(engine: Engine, *, use_cache: bool = True) -> Send[list[int]]:
    """worker.workload.drive's send for an engine in this process: one generation, its TTFT taken
    at the first token."""

    def send(tokens: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
        sent = time.perf_counter()
        first: list[float] = []

        def on_token(_token: int) -> bool:
            first.append(time.perf_counter())
            return False

        result = engine.generate(tokens, max_tokens=max_tokens, use_cache=use_cache, on_token=on_token)
        done = time.perf_counter()
        outcome = Outcome(
            ttft_s=first[0] - sent,
            e2e_s=done - sent,
            output_tokens=len(result.output_ids),
            prompt_tokens=result.trace.prompt_tokens,
            cached_tokens=result.trace.cached_tokens,
        )
        return outcome, tokens + result.output_ids

    return send


def _drive(engine: Engine, config: str, sessions: list[list[TokenStep]], clients: int) -> tuple[list[Outcome], float]:
    """Run each session's requests in order, `clients` sessions at a time, each client one session
    to its end (worker.workload.drive); returns outcomes and wall time."""
    return drive(sessions, engine_send(engine, use_cache=config != "no_cache"), clients=clients, interleave=False)


def _summary(prefix: str, config: str, outcomes: list[Outcome], wall: float) -> list[Row]:
    ttfts = sorted(o.ttft_s for o in outcomes)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    tpot = [(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in outcomes if o.output_tokens > 1]
    tokens = sum(o.output_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    return [
        Row(f"{prefix}.{config}.ttft_mean_s", statistics.mean(ttfts), "s"),
        Row(f"{prefix}.{config}.ttft_p99_s", p99, "s"),
        Row(f"{prefix}.{config}.tpot_ms", 1000 * statistics.mean(tpot) if tpot else 0.0, "ms"),
        Row(
            f"{prefix}.{config}.throughput_tok_s",
            tokens / wall,
            "tok/s",
            note=f"{len(outcomes)} requests, {cached} cached prompt tokens",
        ),
    ]


def _ratios(prefix: str, rows: list[Row]) -> list[Row]:
    values = {r.name: r.value for r in rows}
    out = []
    for config in CONFIGS[1:]:
        out.append(
            Row(
                f"{prefix}.{config}.ttft_vs_no_cache",
                values[f"{prefix}.{config}.ttft_mean_s"] / values[f"{prefix}.no_cache.ttft_mean_s"],
                "x",
                baseline=f"{prefix}.no_cache.ttft_mean_s",
            )
        )
        out.append(
            Row(
                f"{prefix}.{config}.throughput_vs_no_cache",
                values[f"{prefix}.{config}.throughput_tok_s"] / values[f"{prefix}.no_cache.throughput_tok_s"],
                "x",
                baseline=f"{prefix}.no_cache.throughput_tok_s",
            )
        )
    return out


def multi_turn_suite(
    *,
    redis_url: str,
    clients: int = 4,
    requests: int = 60,
    model_name: str = "small",
    system_tokens: int = 1024,
    user_tokens: int = 192,
    answer_tokens: int = 16,
    device_blocks: int = 8,
    progress: Callable[[str], None] = print,
) -> list[Row]:
    """The seeds' multi-turn setup: `clients` concurrent conversations over one shared system prompt,
    each turn adding a user message to the growing history; `requests` requests in all."""
    model = load_model(model_name)
    system = random_prompt(system_tokens, seed=100)
    turns = requests // (2 * clients) or 1
    conversations = requests // turns

    def session(index: int) -> list[TokenStep]:
        def step(turn: int) -> TokenStep:
            def make(history: list[int] | None) -> tuple[list[int], int]:
                user = random_prompt(user_tokens + 1, seed=1000 * index + turn)[1:]
                return (history or system) + user, answer_tokens

            return make

        return [step(turn) for turn in range(turns)]

    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-") as work,
        scratch_tiers(model, blocks=4096, redis_url=redis_url, workdir=Path(work)) as tiers,
    ):
        for config in CONFIGS:
            progress(f"multi-turn: {config} ({conversations} conversations x {turns} turns, {clients} clients)")
            engine = _engine_for(config, model, tiers, device_blocks)
            outcomes, wall = _drive(engine, config, [session(i) for i in range(conversations)], clients)
            rows += _summary(f"multiturn.c{clients}", config, outcomes, wall)
    return rows + _ratios(f"multiturn.c{clients}", rows)


def long_doc_suite(
    *,
    redis_url: str,
    clients: int = 4,
    documents: int = 4,
    questions: int = 3,
    doc_tokens: int = 8192,
    answer_tokens: int = 32,
    model_name: str = "small",
    device_blocks: int = 8,
    progress: Callable[[str], None] = print,
) -> list[Row]:
    """LMCache's long-document QA: each document asked several questions, in shuffled order."""
    model = load_model(model_name)
    docs = [random_prompt(doc_tokens, seed=200 + d) for d in range(documents)]
    order = [(d, q) for d in range(documents) for q in range(questions)]
    random.Random(3).shuffle(order)

    def single(d: int, q: int) -> list[TokenStep]:
        question = random_prompt(33, seed=300 + 10 * d + q)[1:]
        return [lambda _history: (docs[d] + question, answer_tokens)]

    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-") as work,
        scratch_tiers(model, blocks=4096, redis_url=redis_url, workdir=Path(work)) as tiers,
    ):
        for config in CONFIGS:
            progress(f"long-doc QA: {config} ({documents} docs x {questions} questions of {doc_tokens} tokens)")
            engine = _engine_for(config, model, tiers, device_blocks)
            outcomes, wall = _drive(engine, config, [single(d, q) for d, q in order], clients)
            rows += _summary("longdoc", config, outcomes, wall)
    return rows + _ratios("longdoc", rows)
