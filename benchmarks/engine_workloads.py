"""Engine measurements: TTFT of a long prompt per tier against cold prefill and the medium's floor,
and the seeds' serving workloads (multi-turn chat, long-document QA) under four cache setups."""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import torch

from benchmarks.throttle import ThrottleUnavailable, throttled_reads
from worker.dataplane.engine.engine import Engine, EngineOptions
from worker.dataplane.layout import BlockLayout
from worker.dataplane.models.loading import LoadedModel, load_model
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import Tier
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier

BLOCK_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class Measure:
    name: str
    value: float
    unit: str
    baseline: str | None = None
    note: str = ""


def _layout(model: LoadedModel) -> BlockLayout:
    return BlockLayout(
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        block_tokens=BLOCK_TOKENS,
        dtype=model.dtype,
    )


@contextmanager
def _tiers(model: LoadedModel, *, blocks: int, redis_url: str, workdir: Path) -> Iterator[dict[str, Tier]]:
    """One tier of each kind, each big enough for `blocks` blocks; everything removed afterwards."""
    layout = _layout(model)
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


def _prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(tokens - 1)]


def _tier_read_seconds(tier: Tier, keys: list[uuid.UUID], layout: BlockLayout) -> float:
    """The medium's time to deliver these blocks with this tier's own batched reads (best of 3)."""
    outs = [layout.empty() for _ in keys]
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for future in tier.get_layers(keys, range(layout.layers), outs):
            future.result()
        best = min(best, time.perf_counter() - started)
    return best


def ttft_suite(
    *,
    redis_url: str,
    prompt_tokens: int = 8192 + 32,
    model_name: str = "bench",
    progress: Callable[[str], None] = print,
) -> list[Measure]:
    """TTFT of one long prompt: cold, then a hit from each tier with layer-wise loading on and off."""
    model = load_model(model_name)
    layout = _layout(model)
    prompt = _prompt(prompt_tokens, seed=1)
    full_blocks = prompt_tokens // BLOCK_TOKENS
    rows: list[Measure] = []
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-") as work,
        _tiers(model, blocks=full_blocks + 64, redis_url=redis_url, workdir=Path(work)) as tiers,
    ):
        options = EngineOptions(block_tokens=BLOCK_TOKENS, write_back_tier="host", keep_in_device=False, decide=False)
        writer = Engine(model=model, store=TieredStore(layout=layout, tiers=[tiers["host"]]), options=options)
        progress(f"engine: cold prefill of {prompt_tokens} tokens ({model_name} model)")
        cold = writer.generate(prompt, max_tokens=1)
        cold_s = cold.trace.ttft_s
        rows.append(
            Measure("engine.ttft_cold_s", cold_s, "s", note=f"{prompt_tokens}-token prompt, {model_name} model")
        )
        keys = writer.fingerprinter("default").prefix_keys(prompt)
        buffer = layout.empty()
        for name in ("device", "disk", "remote"):
            for key in keys:
                read = tiers["host"].get(key, buffer)
                tiers[name].put(key, buffer, checksum=read.checksum if name != "device" else None)
        kv_bytes = len(keys) * layout.block_bytes
        for name in ("device", "host", "disk", "remote"):
            engine = Engine(
                model=model,
                store=TieredStore(layout=layout, tiers=[tiers[name]]),
                options=dataclasses.replace(options, write_back_tier=name),
            )
            progress(f"engine: hit from {name}")
            # One untimed hit first: the first run of a process's hit path pays for one-time work
            # (kernel set-up for the suffix's shapes, the allocator growing).
            engine.generate(prompt, max_tokens=1)
            results = {}
            for layerwise in (True, False):
                runs = [engine.generate(prompt, max_tokens=1, layerwise=layerwise) for _ in range(3)]
                assert all(r.output_ids == cold.output_ids for r in runs), "a cache hit changed the output"
                assert all(r.trace.cached_tokens == full_blocks * BLOCK_TOKENS for r in runs)
                results[layerwise] = runs
            ttft = statistics.median(r.trace.ttft_s for r in results[True])
            ttft_upfront = statistics.median(r.trace.ttft_s for r in results[False])
            # The floor: the medium delivering these bytes at its measured speed, then computing
            # only the uncached suffix (the compute part of a load-then-compute run).
            read_s = _tier_read_seconds(tiers[name], keys, layout)
            suffix_s = statistics.median(r.trace.prefill_s for r in results[False])
            floor = read_s + suffix_s
            rows += [
                Measure(f"engine.ttft_hit_{name}_s", ttft, "s", note="layer-wise"),
                Measure(f"engine.ttft_hit_{name}_vs_cold", ttft / cold_s, "x", baseline="engine.ttft_cold_s"),
                Measure(f"engine.ttft_hit_{name}_load_then_compute_s", ttft_upfront, "s"),
                Measure(
                    f"engine.ttft_hit_{name}_layerwise_vs_upfront",
                    ttft / ttft_upfront,
                    "x",
                    baseline=f"engine.ttft_hit_{name}_load_then_compute_s",
                ),
                Measure(
                    f"engine.ttft_hit_{name}_floor_s",
                    floor,
                    "s",
                    note=f"{kv_bytes / read_s / 1e9:.2f} GB/s read + {suffix_s * 1000:.0f} ms suffix compute",
                ),
                Measure(
                    f"engine.ttft_hit_{name}_vs_floor", ttft / floor, "x", baseline=f"engine.ttft_hit_{name}_floor_s"
                ),
            ]
        rows += _balanced_case(model_name, Path(work), options, progress)
        rows += _throttled_balanced_case(model_name, Path(work), options, progress)
    return rows


THROTTLED_READ_BPS = 200_000_000
"""The slower medium of the throttled balanced case: 200 MB/s, a network volume's or a busy cloud
disk's rate, well below a local SSD's."""


THROTTLED_MODEL = "bench-deep"
THROTTLED_PREFIX_BLOCKS = 8
"""The throttled case runs the bench model's shape with Llama-3-8B's 32 layers: layer-wise loading
cannot start computing before the first layer of the prefix is in, 1/layers of the load, so with
8 layers even a perfect pipeline takes (1 + 1/8) / 2 = 0.56 of load-then-compute when the two are
equal, and 32 layers bring that floor to 0.52. Eight 256-token blocks of 32 layers are 128 MiB in
float32, 0.64 s at the throttled rate."""
THROTTLED_COMPUTE_THREADS = 1
"""Compute threads of the throttled case, both ways (load-then-compute and layer-wise): the other
core is left to the medium's I/O, as a GPU node's compute never shares its processor with the
loader. With both cores computing, every read's completion (interrupt, wake-up, the hash of the
layer) takes a core from one of torch's two threads, and the other waits for it at each
operation, which stretches the layer-wise run's compute with no stall at all (figures in
benchmarks/README.md)."""


@contextmanager
def _compute_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _throttled_balanced_case(
    model_name: str, workdir: Path, options: EngineOptions, progress: Callable[[str], None]
) -> list[Measure]:
    """The balanced case again with the disk's reads held to THROTTLED_READ_BPS by the kernel's
    block throttle (benchmarks.throttle): the load is then the medium's time (the CPU waits, as a
    GPU's compute waits on DMA) where on the local disk it is mostly CPU and memory traffic
    competing with the compute itself. The throttle releases reads in 100 ms slices, so layers
    arrive in steps rather than evenly. On THROTTLED_MODEL (`model_name` is the suite's model,
    whose shape it shares), computing on THROTTLED_COMPUTE_THREADS. Needs root and a cgroup block
    controller; without them the rows are left out and the reason is logged."""
    model = load_model(THROTTLED_MODEL, dtype="float32")
    layout = _layout(model)
    disk = DiskTier(layout=layout, capacity_bytes=48 * layout.block_bytes, path=workdir / "throttled")
    try:
        with throttled_reads(workdir, THROTTLED_READ_BPS) as how, _compute_threads(THROTTLED_COMPUTE_THREADS):
            progress(f"engine: throttled balanced case, {how}, computing on {THROTTLED_COMPUTE_THREADS} thread(s)")
            return _balanced_runs(
                model,
                disk,
                layout,
                options,
                progress,
                name="balanced_throttled",
                medium=f"disk reads held to {THROTTLED_READ_BPS / 1e6:.0f} MB/s",
                prefix_blocks=THROTTLED_PREFIX_BLOCKS,
            )
    except ThrottleUnavailable as exc:
        progress(f"engine: throttled balanced case left out: {exc}")
        return []
    finally:
        disk.close()


def _balanced_case(
    model_name: str, workdir: Path, options: EngineOptions, progress: Callable[[str], None]
) -> list[Measure]:
    """Layer-wise against load-then-compute where loading the prefix takes about as long as
    computing the suffix: the case pipelining is for. The suffix length is calibrated here from
    the measured load time of the prefix and the measured compute time of the suffix.

    The model runs in float32, as a CPU deployment would run it: on a CPU without bfloat16
    arithmetic every layer's weights cost far more than any load in bfloat16 (and a balanced
    case cannot be built at any suffix length)."""
    model = load_model(model_name, dtype="float32")
    layout = _layout(model)
    disk = DiskTier(layout=layout, capacity_bytes=48 * layout.block_bytes, path=workdir / "balanced")
    try:
        return _balanced_runs(model, disk, layout, options, progress)
    finally:
        disk.close()


def _balanced_runs(
    model: LoadedModel,
    disk: Tier,
    layout: BlockLayout,
    options: EngineOptions,
    progress: Callable[[str], None],
    *,
    name: str = "balanced",
    medium: str = "disk",
    prefix_blocks: int = 32,
) -> list[Measure]:
    prefix = _prompt(prefix_blocks * BLOCK_TOKENS, seed=7)
    engine = Engine(
        model=model,
        store=TieredStore(layout=layout, tiers=[disk]),
        options=dataclasses.replace(options, write_back_tier=disk.name),
    )
    engine.generate(prefix + [5], max_tokens=1)

    def probe(suffix: int, seed: int) -> tuple[float, float]:
        runs = [
            engine.generate(
                prefix + _prompt(suffix + 1, seed=seed + i)[1:], max_tokens=1, layerwise=False, write_back=False
            )
            for i in range(3)
        ]
        assert all(r.trace.cached_tokens == prefix_blocks * BLOCK_TOKENS for r in runs), "the prefix must be a hit"
        return (statistics.median(r.trace.load_s for r in runs), statistics.median(r.trace.prefill_s for r in runs))

    # Computing a suffix over a cached prefix is not linear in its length (one token takes
    # attention's single-query path, longer suffixes a masked one), so the length is searched:
    # the first whose measured compute reaches the measured load, or the one before it if closer.
    probe(1, seed=40)  # warm-up: the first runs of a freshly loaded model are slower
    best: tuple[float, int, float, float] | None = None

    def reaches(length: int) -> bool:
        """Probe a suffix length, keep it if it is the closest to the load yet; True when its
        compute reaches the load."""
        nonlocal best
        load_s, compute_s = probe(length, seed=8 + length)
        gap = abs(compute_s - load_s) / load_s
        if best is None or gap < best[0]:
            best = (gap, length, load_s, compute_s)
        return compute_s >= load_s

    below = 0  # the longest suffix probed whose compute was under the load
    above = 0  # the first whose compute reached it
    for length in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048):
        if reaches(length):
            above = length
            break
        below = length
    # The steps of the list grow by half: bisect between the two lengths around the crossing,
    # so the case is balanced to a few percent rather than to a step of the list.
    for _ in range(3):
        if not below or above - below < 2:
            break
        middle = (below + above) // 2
        if reaches(middle):
            above = middle
        else:
            below = middle
    assert best is not None
    _gap, suffix_tokens, load_s, compute_s = best
    progress(
        f"engine: {name} case, load {load_s * 1000:.0f} ms vs {suffix_tokens}-token suffix "
        f"computed in {compute_s * 1000:.0f} ms"
    )
    prompt = prefix + _prompt(suffix_tokens + 1, seed=9)[1:]
    upfront, layerwise, loads, computes = [], [], [], []
    for _ in range(5):  # interleaved, so drift hits both alike
        # No write-back: a suffix of a whole block or more would be stored and then found too.
        run = engine.generate(prompt, max_tokens=1, layerwise=False, write_back=False).trace
        upfront.append(run.ttft_s)
        loads.append(run.load_s)
        computes.append(run.prefill_s)
        layerwise.append(engine.generate(prompt, max_tokens=1, layerwise=True, write_back=False).trace.ttft_s)
    load_s, compute_s = statistics.median(loads), statistics.median(computes)
    ideal = max(load_s, compute_s) / (load_s + compute_s)
    return [
        Measure(
            f"engine.{name}_load_s",
            load_s,
            "s",
            note=f"{prefix_blocks} blocks of {model.name} in float32 from {medium}, read alone",
        ),
        Measure(f"engine.{name}_compute_s", compute_s, "s", note=f"{suffix_tokens}-token suffix, computed alone"),
        Measure(
            f"engine.{name}_ideal_vs_upfront", ideal, "x", note="max(load, compute) / (load + compute): perfect overlap"
        ),
        Measure(
            f"engine.{name}_load_then_compute_s",
            statistics.median(upfront),
            "s",
            note=f"{prefix_blocks} blocks from {medium} ({load_s * 1000:.0f} ms) + {suffix_tokens}-token suffix",
        ),
        Measure(f"engine.{name}_layerwise_s", statistics.median(layerwise), "s"),
        Measure(
            f"engine.{name}_layerwise_vs_upfront",
            statistics.median(layerwise) / statistics.median(upfront),
            "x",
            baseline=f"engine.{name}_load_then_compute_s",
        ),
    ]


# -- serving workloads ----------------------------------------------------------------------------

CONFIGS = ("no_cache", "device_only", "strata_host", "strata_disk")


@dataclasses.dataclass
class Outcome:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    cached_tokens: int


def _engine_for(config: str, model: LoadedModel, tiers: dict[str, Tier], device_blocks: int) -> Engine:
    layout = _layout(model)
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


def _drive(
    engine: Engine, config: str, sessions: list[list[Callable[[list[int]], tuple[list[int], int]]]], clients: int
) -> tuple[list[Outcome], float]:
    """Run each session's requests in order, `clients` sessions at a time; returns outcomes and wall time."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    queue = list(range(len(sessions)))

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            history: list[int] = []
            for step in sessions[index]:
                prompt, max_tokens = step(history)
                sent = time.perf_counter()
                first: list[float] = []

                def on_token(_token: int, first: list[float] = first) -> bool:
                    first.append(time.perf_counter())
                    return False

                result = engine.generate(
                    prompt, max_tokens=max_tokens, use_cache=config != "no_cache", on_token=on_token
                )
                done = time.perf_counter()
                history = prompt + result.output_ids
                with lock:
                    outcomes.append(
                        Outcome(first[0] - sent, done - sent, len(result.output_ids), result.trace.cached_tokens)
                    )

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - started


def _summary(prefix: str, config: str, outcomes: list[Outcome], wall: float) -> list[Measure]:
    ttfts = sorted(o.ttft_s for o in outcomes)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    tpot = [(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in outcomes if o.output_tokens > 1]
    tokens = sum(o.output_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    return [
        Measure(f"{prefix}.{config}.ttft_mean_s", statistics.mean(ttfts), "s"),
        Measure(f"{prefix}.{config}.ttft_p99_s", p99, "s"),
        Measure(f"{prefix}.{config}.tpot_ms", 1000 * statistics.mean(tpot) if tpot else 0.0, "ms"),
        Measure(
            f"{prefix}.{config}.throughput_tok_s",
            tokens / wall,
            "tok/s",
            note=f"{len(outcomes)} requests, {cached} cached prompt tokens",
        ),
    ]


def _ratios(prefix: str, rows: list[Measure]) -> list[Measure]:
    values = {r.name: r.value for r in rows}
    out = []
    for config in CONFIGS[1:]:
        out.append(
            Measure(
                f"{prefix}.{config}.ttft_vs_no_cache",
                values[f"{prefix}.{config}.ttft_mean_s"] / values[f"{prefix}.no_cache.ttft_mean_s"],
                "x",
                baseline=f"{prefix}.no_cache.ttft_mean_s",
            )
        )
        out.append(
            Measure(
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
) -> list[Measure]:
    """The seeds' multi-turn setup: `clients` concurrent conversations over one shared system prompt,
    each turn adding a user message to the growing history; `requests` requests in all."""
    model = load_model(model_name)
    system = _prompt(system_tokens, seed=100)
    turns = requests // (2 * clients) or 1
    conversations = requests // turns

    def session(index: int) -> list[Callable[[list[int]], tuple[list[int], int]]]:
        def step(turn: int) -> Callable[[list[int]], tuple[list[int], int]]:
            def make(history: list[int]) -> tuple[list[int], int]:
                user = _prompt(user_tokens + 1, seed=1000 * index + turn)[1:]
                return (history or system) + user, answer_tokens

            return make

        return [step(turn) for turn in range(turns)]

    rows: list[Measure] = []
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-") as work,
        _tiers(model, blocks=4096, redis_url=redis_url, workdir=Path(work)) as tiers,
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
) -> list[Measure]:
    """LMCache's long-document QA: each document asked several questions, in shuffled order."""
    model = load_model(model_name)
    docs = [_prompt(doc_tokens, seed=200 + d) for d in range(documents)]
    order = [(d, q) for d in range(documents) for q in range(questions)]
    random.Random(3).shuffle(order)

    def single(d: int, q: int) -> list[Callable[[list[int]], tuple[list[int], int]]]:
        question = _prompt(33, seed=300 + 10 * d + q)[1:]
        return [lambda _history: (docs[d] + question, answer_tokens)]

    rows: list[Measure] = []
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-") as work,
        _tiers(model, blocks=4096, redis_url=redis_url, workdir=Path(work)) as tiers,
    ):
        for config in CONFIGS:
            progress(f"long-doc QA: {config} ({documents} docs x {questions} questions of {doc_tokens} tokens)")
            engine = _engine_for(config, model, tiers, device_blocks)
            outcomes, wall = _drive(engine, config, [single(d, q) for d, q in order], clients)
            rows += _summary("longdoc", config, outcomes, wall)
    return rows + _ratios("longdoc", rows)


def torch_threads() -> int:
    return torch.get_num_threads()
