"""Suite `fleet`: cross-node reuse through L3. Multi-turn chat, 4 clients, with the turns of each
conversation assigned round-robin across two nodes (turn t of conversation i on node (i + t) mod 2,
so every next turn lands on the other node, as a load balancer without affinity sends it).

Each node is an engine with its own device pool, host pool (its own shared-memory segment) and
disk, sharing one remote tier (L3, Redis); both serve from this process and split this machine's
CPUs as the one node of the baseline has them all: their steps take turns at the model, as one
node's requests do (without that, two prefills on two cores at once slow each other down and the
ratio measures the oversubscription, not the cache). A write-through request answers once its
blocks are in L3, and a node keeps what it read from L3 in its host tier. Setups:

- ``one_node``: every conversation on one node (its host tier holds each previous turn);
- ``two_nodes.round_robin.sharing``: two nodes, the default class writes through to L3 at
  write-back, so the next turn finds the previous one in L3 on the other node;
- ``two_nodes.round_robin.no_sharing``: two nodes, on-demotion (nothing reaches L3 at once), so a
  turn on the other node recomputes what was said since that node's own turn before.

Rows: mean TTFT of each setup and two ratios, each the median of `repeats` interleaved runs
(min - max in the note): ``ttft_vs_one_node`` (sharing / one node, target <= 1.3) and
``ttft_vs_no_sharing`` (sharing / no sharing, target <= 0.5), and ``computed_tokens_vs_no_sharing``:
the prompt tokens each prefilled, sharing / no sharing, which is about as low as the TTFT ratio
can go. The lookup asks L3 itself (no directory), which is what a node does when the directory's
answer names no local copy. Sizes at scale 1: the `small` model, a 2048-token shared system
prompt, 96-token user turns, 16-token answers (STRATA_BENCH_FLEET_ANSWER), 48 requests (6 turns
of 8 conversations).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis

from benchmarks.harness import Context, Row
from benchmarks.workloads.engine import block_layout, engine_send, random_prompt
from controlplane.runtime.environment import load_environment
from worker.dataplane.engine.engine import Engine, EngineOptions
from worker.dataplane.engine.turns import Turns
from worker.dataplane.models.loading import LoadedModel, load_model
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier
from worker.workload import Outcome, Step, drive

DESCRIPTION = "Cross-node reuse through L3: two nodes, round-robin turns, vs one node and vs no sharing"
SETUPS = ("one_node", "two_nodes.round_robin.sharing", "two_nodes.round_robin.no_sharing")
PREFIX = "fleet"
EXPECTED_ROWS = (
    *(f"{PREFIX}.{setup}.ttft_mean_s" for setup in SETUPS),
    f"{PREFIX}.two_nodes.round_robin.computed_tokens_vs_no_sharing",
)
"""Each setup's TTFT, and what sharing through L3 saves."""
CLIENTS = 4
USER_TOKENS = 96
ANSWER_TOKENS = int(os.environ.get("STRATA_BENCH_FLEET_ANSWER", "16"))
DEVICE_BLOCKS = 8
WRITE_THROUGH = [{"name": "default", "namespaces": [], "remote_write": "write-through"}]
ON_DEMOTION = [{"name": "default", "namespaces": [], "remote_write": "on-demotion"}]


@contextmanager
def _nodes(model: LoadedModel, count: int, *, sharing: bool, redis_url: str) -> Iterator[list[Engine]]:
    """`count` engines, each with its own device, host and disk tiers, sharing one L3 prefix."""
    layout = block_layout(model)
    capacity = 4096 * layout.block_bytes
    prefix = f"strata-bench-fleet-{uuid.uuid4().hex[:8]}"
    pools: list[str] = []
    turns = Turns()  # the nodes split this machine's CPUs: their steps take turns, as one node's do
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="strata-bench-fleet-") as work:
        engines = []
        for index in range(count):
            pool = f"strata-bench-fleet-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            pools.append(pool)
            client = redis.Redis.from_url(redis_url, socket_timeout=30)
            store = TieredStore(
                layout=layout,
                tiers=[
                    DeviceTier(layout=layout, capacity_bytes=DEVICE_BLOCKS * layout.block_bytes),
                    HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
                    DiskTier(layout=layout, capacity_bytes=capacity, path=Path(work) / f"disk-{index}"),
                    RemoteTier(layout=layout, capacity_bytes=capacity, client=client, prefix=prefix),
                ],
            )
            stack.callback(store.close)
            engine = Engine(
                model=model,
                store=store,
                node=f"node-{index}",
                turns=turns,
                options=EngineOptions(
                    block_tokens=layout.block_tokens, write_back_tier="host", keep_in_device=True, decide=False
                ),
            )
            engine.offload.remote_writer.set_classes(WRITE_THROUGH if sharing else ON_DEMOTION)
            engines.append(engine)
        try:
            yield engines
        finally:
            for engine in engines:
                engine.offload.remote_writer.drain(timeout=60)
            stack.close()
            for pool in pools:
                Path("/dev/shm", pool).unlink(missing_ok=True)
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
            client.close()


Routed = tuple[int, list[int]]
"""A fleet request: the index of the engine that serves it, and its token ids."""


def _drive(
    engines: list[Engine], conversations: int, turns: int, make: Callable[[int, int, list[int] | None], list[int]]
) -> tuple[list[float], int, int]:
    """Run the conversations, `CLIENTS` at a time (worker.workload.drive, each client one
    conversation to its end), turn t of conversation i on engine (i + t) mod len(engines); the
    TTFTs of every request, and the prompt tokens served from the cache and computed, in all."""
    sends = [engine_send(engine) for engine in engines]

    def conversation(index: int) -> list[Step[Routed]]:
        def turn(number: int) -> Step[Routed]:
            def routed(history: Routed | None) -> tuple[Routed, int]:
                tokens = make(index, number, history[1] if history is not None else None)
                return ((index + number) % len(engines), tokens), ANSWER_TOKENS

            return routed

        return [turn(number) for number in range(turns)]

    def send(request: Routed, max_tokens: int) -> tuple[Outcome, Routed]:
        outcome, history = sends[request[0]](request[1], max_tokens)
        return outcome, (request[0], history)

    outcomes, _wall = drive([conversation(i) for i in range(conversations)], send, clients=CLIENTS, interleave=False)
    cached = sum(o.cached_tokens for o in outcomes)
    return [o.ttft_s for o in outcomes], cached, sum(o.prompt_tokens for o in outcomes) - cached


def run(ctx: Context) -> list[Row]:
    redis_url = load_environment().redis.url_for_db(7)
    scale = min(ctx.scale, 1.0)
    system_tokens = max(512, int(2048 * scale))
    turns = 6 if scale >= 0.5 else 4
    conversations = 2 * CLIENTS
    model_name = os.environ.get("STRATA_BENCH_FLEET_MODEL", "small")
    model = load_model(model_name)
    ctx.params.update(
        model=model_name,
        clients=CLIENTS,
        system_tokens=system_tokens,
        user_tokens=USER_TOKENS,
        answer_tokens=ANSWER_TOKENS,
        turns=turns,
    )
    system = random_prompt(system_tokens, seed=100)

    def make(index: int, turn: int, history: list[int] | None) -> list[int]:
        return (history or system) + random_prompt(USER_TOKENS + 1, seed=1000 * index + turn)[1:]

    ctx.plan(ctx.repeats * len(SETUPS))
    means: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    cached: dict[str, list[int]] = {setup: [] for setup in SETUPS}
    computed: dict[str, list[int]] = {setup: [] for setup in SETUPS}
    for repeat in range(ctx.repeats):
        order = SETUPS if repeat % 2 == 0 else SETUPS[::-1]  # interleaved, alternating order
        for setup in order:
            count = 1 if setup == "one_node" else 2
            with _nodes(model, count, sharing=setup.endswith(".sharing"), redis_url=redis_url) as engines:
                ttfts, hit, work = _drive(engines, conversations, turns, make)
            means[setup].append(statistics.mean(ttfts))
            cached[setup].append(hit)
            computed[setup].append(work)
            ctx.step(f"{setup} run {repeat + 1}: mean TTFT {means[setup][-1] * 1000:.1f} ms, {hit} cached tokens")
    rows = [
        Row(
            name=f"{PREFIX}.{setup}.ttft_mean_s",
            value=statistics.median(means[setup]),
            unit="s",
            note=f"runs {_spread(means[setup])}; cached prompt tokens per run {statistics.median(cached[setup]):.0f}",
        )
        for setup in SETUPS
    ]
    sharing = means["two_nodes.round_robin.sharing"]
    for name, baseline, target in (
        ("ttft_vs_one_node", "one_node", 1.3),
        ("ttft_vs_no_sharing", "two_nodes.round_robin.no_sharing", 0.5),
    ):
        ratios = [s / b for s, b in zip(sharing, means[baseline], strict=True)]
        rows.append(
            Row(
                name=f"{PREFIX}.two_nodes.round_robin.{name}",
                value=statistics.median(ratios),
                unit="x",
                baseline=f"{PREFIX}.{baseline}.ttft_mean_s",
                note=f"target <= {target}; runs {_spread(ratios)}",
            )
        )
    ratios = [
        s / b
        for s, b in zip(
            computed["two_nodes.round_robin.sharing"], computed["two_nodes.round_robin.no_sharing"], strict=True
        )
    ]
    rows.append(
        Row(
            name=f"{PREFIX}.two_nodes.round_robin.computed_tokens_vs_no_sharing",
            value=statistics.median(ratios),
            unit="x",
            note=f"prompt tokens prefilled, sharing / no sharing (what TTFT can fall to); runs {_spread(ratios)}",
        )
    )
    return rows


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} - {max(values):.3f} (n={len(values)})"
