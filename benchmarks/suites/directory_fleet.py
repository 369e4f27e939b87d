"""Suite `directory_fleet`: how many nodes one directory database serves within the lookup target,
each node offering the save and lookup rates of the vLLM bench's requests.

Like the `directory` suite, it creates its own scratch database (``strata_bench_directory_fleet_<pid>``),
migrates it and seeds it with COPY (1M blocks; 10M with ``--scale 10``), then ramps a fleet of
simulated nodes, N = 1, 2, 4, 8, ...: each node is registered by a heartbeat and drives the node's
own directory client (``worker.postgres_directory.PostgresDirectory``, the code a node runs: its own
reader connection for lookups, its own write-behind writer for registrations and touches). Per
request a node looks up a prompt's keys, touches the hits it found and registers the blocks it
saved, at Poisson arrivals of its request rate. A step measures, as the nodes see it, the lookup
latency (p50, p99), the registrations the directory took per second against those the nodes
queued (and the mean offered), and the write-behind backlog left in the clients. The ramp stops at
the first step whose registrations fall behind (under 95% of those queued taken), where a lookup
failed or the lookup p99 passed 20 ms; `directory_fleet.<setup>.max_nodes` is the largest N whose
lookup p99 was within 2 ms with everything kept up (a step over 2 ms below it does not end the
ramp: on a shared machine one noisy window can miss, and the p99 falls as the server stops going
idle between lookups). The ramp also stops where another doubling would not fit the server's
``max_connections`` (two connections a node; it then tries the largest N that fits), where the
load generator cannot send what the nodes offer, or at ``STRATA_BENCH_FLEET_MAX_NODES`` (default
1024; 4 below scale 0.05, as the smoke runs it).

Where the rates come from (every row's params name the source of each):

* Requests per second of one node: ``STRATA_BENCH_FLEET_REQUESTS_PER_S``, default 16, a GPU node
  (the issue sizes the fleet as 1,000 GPUs each saving a few dozen 256-token blocks a second; 16
  requests/s of the multi-turn shape below save about 27). The vLLM bench's own request rate is a
  CPU node's and is not used.
* Per request (keys asked in its lookup, blocks it saved, hits it touched): the means over the
  request timelines the vLLM bench kept of its ``strata_host`` server
  (``var/bench-logs/vllm/strata_host-requests.json``: ``prompt_tokens`` / 256, ``written_blocks``,
  ``hit_blocks_by_tier``) when that file exists; else the vLLM bench's multi-turn workload at
  scale 1 (``benchmarks.workloads.sessions.Shape``) worked out on 256-token blocks: each turn looks
  up its prompt's full blocks, hits those the turns before saved and saves the rest.

The load generator runs on this machine and shares its cores with the database server: several
worker processes (``STRATA_BENCH_FLEET_PROCESSES``, default twice the CPUs), each one thread per
node plus each client's writer thread. Every step reports the cores the generator used and the
cores the whole machine was busy, so a reader can judge how much of the database's time it took;
a lookup latency here includes the generator's own scheduling delays, as a node's would include
its engine's. The nodes connect as the database's owner (no node roles, no row-level security;
the `directory` suite measures what those cost) and announce nothing to the dashboard.

Setups (`SETUPS`; ``STRATA_BENCH_FLEET_SETUPS=primary`` runs one): ``primary``, every node's reads
and writes on the one server; ``replica``, the nodes' lookups on a streaming standby of it
(`controlplane.runtime.replica`, started with `pg_basebackup` once the directory is seeded, tuned
like the embedded primary) through the client's read-replica option (staleness bound 1 s), their
writes on the primary. Both servers share this machine's cores, so the replica row says what the
standby costs and whether it serves, not what a second machine adds; its steps carry the share of
reads the standby served. A setup is the database endpoints it gives the nodes (`Endpoints`:
``write_url``, ``read_url``), yielded by its `provision` context for as long as its ramp runs; each
node's client is built on them by `_client`; its rows are ``directory_fleet.<setup>.*`` and the
connection room is counted per server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.suites.directory import (
    CHAIN,
    MODELS,
    NAMESPACES,
    World,
    _percentile,
    _scope,
    _seed,
    machine_jiffies,
)

DESCRIPTION = "largest fleet of simulated nodes one directory serves within lookup p99 <= 2 ms (1M blocks)"


def expected_rows(ctx: Any) -> list[str]:
    """Per setup run: the largest fleet within the target, and at least the first step of its ramp."""
    return [
        f"directory_fleet.{name}.{row}"
        for name in setups_chosen()
        for row in ("max_nodes", "n1.lookup_p99_ms", "n1.registered_per_s")
    ]


FULL_BLOCKS = 1_000_000
BENCH_DB_PREFIX = "strata_bench_directory_fleet"
LOOKUP_P99_TARGET_MS = 2.0
LOOKUP_P99_CEILING_MS = 20.0
"""Past this lookup p99 the ramp stops: the fleet is far past its target. Below it a step that
misses the target does not end the ramp (on a shared machine one noisy window can; the next,
larger fleet may still meet it): `max_nodes` is the largest fleet that met it."""
KEEP_UP = 0.95
"""Registrations taken over those the nodes queued, at least, for a step to count as kept up."""
GENERATOR_KEEP_UP = 0.9
"""Requests sent over those due (their Poisson arrivals in the windows) below which the generator,
not the directory, is the limit."""
CONNECTIONS_PER_NODE = 2
"""A node's client holds one reader connection (its lookups are one at a time) and one writer,
both on one server when its reads and writes go to one."""
BLOCK_TOKENS = 256
DEFAULT_REQUESTS_PER_S = 16.0
SMALL_SCALE = 0.05
SAMPLE_CHAINS = 1024
"""Seeded chains handed to the nodes to look up (their leading blocks are the hits)."""
TARGETS = {"max_nodes": f"lookup p99 <= {LOOKUP_P99_TARGET_MS:g} ms and registrations keeping up"}


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The databases a setup's nodes use: writes always go to `write_url`; lookups to `read_url`."""

    write_url: str
    read_url: str


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way of deploying the directory for the fleet: its rows are `directory_fleet.<name>.*`."""

    name: str
    describe: str
    provision: Callable[[str], contextlib.AbstractContextManager[Endpoints]]
    """Given the scratch database's URL, the endpoints for the nodes, for as long as the ramp runs."""


@contextlib.contextmanager
def _primary(url: str) -> Iterator[Endpoints]:
    yield Endpoints(write_url=url, read_url=url)


@contextlib.contextmanager
def _replica(url: str) -> Iterator[Endpoints]:
    """A streaming standby of the embedded server the scratch database is on, for lookups."""
    import urllib.parse

    from controlplane.runtime.embedded import EmbeddedPostgres, _memory_bytes, server_settings
    from controlplane.runtime.environment import load_environment
    from controlplane.runtime.replica import streaming_standby

    environ = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    server = EmbeddedPostgres(load_environment(environ))
    dbname = urllib.parse.unquote(urllib.parse.urlsplit(url).path.lstrip("/"))
    with streaming_standby(server, settings=server_settings(_memory_bytes())) as standby:
        yield Endpoints(write_url=url, read_url=standby.url(dbname))


SETUPS = (
    Setup("primary", "lookups and writes on the one primary", _primary),
    Setup("replica", "lookups on a streaming standby (1 s staleness bound), writes on the primary", _replica),
)


def setups_chosen() -> list[str]:
    """The setups this run measures: STRATA_BENCH_FLEET_SETUPS (comma-separated), else all; the
    replica needs the embedded server (it copies its data directory)."""
    from controlplane.runtime.environment import load_environment

    known = [setup.name for setup in SETUPS]
    raw = os.environ.get("STRATA_BENCH_FLEET_SETUPS", "")
    chosen = [name.strip() for name in raw.split(",") if name.strip()] or known
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise ValueError(f"STRATA_BENCH_FLEET_SETUPS: unknown setup {unknown[0]!r} (known: {', '.join(known)})")
    if "replica" in chosen and not load_environment().embedded_postgres:
        if raw:
            raise ValueError(
                "STRATA_BENCH_FLEET_SETUPS: the replica setup starts a standby of the embedded PostgreSQL; "
                "with DATABASE_URL set, choose primary"
            )
        chosen.remove("replica")
    return chosen


@dataclasses.dataclass(frozen=True)
class Offered:
    """What one node offers: requests per second, and per request the keys it looks up, the hits
    it touches (one touch a hit) and the blocks it saves (means; each request rounds them at
    random)."""

    requests_per_s: float
    keys_per_lookup: float
    touches_per_request: float
    blocks_saved_per_request: float
    sources: dict[str, str]

    def params(self) -> dict[str, Any]:
        return {
            "requests_per_s_per_node": self.requests_per_s,
            "keys_per_lookup": round(self.keys_per_lookup, 3),
            "touches_per_request": round(self.touches_per_request, 3),
            "blocks_saved_per_request": round(self.blocks_saved_per_request, 3),
            "rate_sources": self.sources,
        }


# -- the harness side ------------------------------------------------------------------------------


def run(ctx: Any) -> list[Any]:
    from benchmarks.harness import run_child
    from benchmarks.runtime.database import django_child_env, scratch_database

    blocks = max(CHAIN * NAMESPACES * MODELS * 32, int(FULL_BLOCKS * ctx.scale) // CHAIN * CHAIN)
    offered = offered_per_node()
    name = f"{BENCH_DB_PREFIX}_{os.getpid()}"
    spec = {
        "blocks": blocks,
        "repeats": ctx.repeats,
        "scale": ctx.scale,
        "offered": dataclasses.asdict(offered),
        "max_nodes": int(os.environ.get("STRATA_BENCH_FLEET_MAX_NODES", str(max_nodes_default(ctx.scale)))),
        "processes": int(os.environ.get("STRATA_BENCH_FLEET_PROCESSES", str(2 * (os.cpu_count() or 1)))),
        "setups": setups_chosen(),
    }
    ctx.params.update(blocks=blocks, database=name, **offered.params())
    with scratch_database(name) as url:
        env = django_child_env(url)
        spec["url"] = url
        notes = {f"directory_fleet.{name}.max_nodes": TARGETS["max_nodes"] for name in spec["setups"]}
        return run_child(ctx, "benchmarks.suites.directory_fleet", spec, env, notes=notes)


def max_nodes_default(scale: float) -> int:
    """Where the ramp ends at the latest: 1024 nodes; 4 below scale 0.05, where a run (the smoke)
    checks that the suite runs whole, not how far it goes."""
    return 1024 if scale >= SMALL_SCALE else 4


def offered_per_node() -> Offered:
    """The per-node load: the request rate from the environment, the per-request shape from the
    vLLM bench's request timelines when it kept some, else from its multi-turn workload."""
    from controlplane.runtime.environment import load_environment

    rate_env = os.environ.get("STRATA_BENCH_FLEET_REQUESTS_PER_S")
    rate = float(rate_env) if rate_env else DEFAULT_REQUESTS_PER_S
    if rate <= 0:
        raise ValueError(f"STRATA_BENCH_FLEET_REQUESTS_PER_S: must be greater than zero, got {rate_env!r}")
    rate_source = (
        "STRATA_BENCH_FLEET_REQUESTS_PER_S"
        if rate_env
        else f"default {DEFAULT_REQUESTS_PER_S:g}/s: a GPU node saving a few dozen 256-token blocks a second (issue 41)"
    )
    traces = load_environment().var_dir / "bench-logs" / "vllm" / "strata_host-requests.json"
    shape = _shape_from_traces(traces) if traces.exists() else None
    if shape is None:
        keys, touches, saved = _shape_from_workload()
        source = (
            "the vllm suite's multi-turn workload at scale 1 (benchmarks.workloads.sessions.Shape), 256-token blocks"
        )
    else:
        keys, touches, saved = shape
        source = f"means over the vllm suite's request timelines {traces}"
    return Offered(
        requests_per_s=rate,
        keys_per_lookup=keys,
        touches_per_request=touches,
        blocks_saved_per_request=saved,
        sources={
            "requests_per_s": rate_source,
            "keys_per_lookup": source,
            "touches_per_request": source,
            "blocks_saved_per_request": source,
        },
    )


def _shape_from_traces(path: Path) -> tuple[float, float, float] | None:
    """(keys per lookup, touches per request, blocks saved per request) over the request timelines
    a vLLM server kept (`GET /v1/strata/requests`); None when it kept none."""
    requests = json.loads(path.read_text()).get("requests") or []
    if not requests:
        return None
    keys = statistics.fmean(r["prompt_tokens"] // BLOCK_TOKENS for r in requests)
    touches = statistics.fmean(sum(r["hit_blocks_by_tier"].values()) for r in requests)
    saved = statistics.fmean(r["written_blocks"] for r in requests)
    return keys, touches, saved


def _shape_from_workload() -> tuple[float, float, float]:
    """The vLLM bench's multi-turn conversations at scale 1 on 256-token blocks: turn t's prompt is
    the private context, the turns before (question and answer) and its question; its lookup asks
    the prompt's full blocks, hits those saved by the turns before and saves the rest."""
    from benchmarks.workloads.sessions import Shape

    shape = Shape()
    keys, touches, saved = [], [], []
    stored = 0
    for turn in range(shape.turns):
        prompt = shape.context_tokens + turn * (shape.user_tokens + shape.answer_tokens) + shape.user_tokens
        full = prompt // BLOCK_TOKENS
        keys.append(full)
        touches.append(min(stored, full))
        saved.append(max(0, full - stored))
        stored = max(stored, full)
    return statistics.fmean(keys), statistics.fmean(touches), statistics.fmean(saved)


# -- the child process (Django configured for the bench database) --------------------------------


def _emit(**message: Any) -> None:
    print(json.dumps(message), flush=True)


def _row(name: str, value: float, unit: str, **params: Any) -> None:
    _emit(row={"name": name, "value": round(value, 4), "unit": unit, "params": params})


@dataclasses.dataclass
class Step:
    """What one step of the ramp measured (medians over its windows)."""

    nodes: int
    lookup_p50_ms: float
    lookup_p99_ms: float
    lookups_per_s: float
    offered_lookups_per_s: float
    scheduled_lookups_per_s: float
    """Requests whose Poisson arrival fell in the windows (the offered rate, as drawn)."""
    registered_per_s: float
    queued_registrations_per_s: float
    """Blocks the nodes saved (handed to their clients' write-behind) per second."""
    offered_registrations_per_s: float
    backlog: int
    """Registrations still queued in the nodes' clients at the end of the step."""
    lookup_failures: int
    dropped_touches: int
    generator_cores: float
    machine_busy_cores: float
    replica_read_share: float
    """Reads (lookups and salts) the standby served, over all the nodes' reads; 0 without one."""

    @property
    def within_target(self) -> bool:
        return self.lookup_p99_ms <= LOOKUP_P99_TARGET_MS and self.lookup_failures == 0

    @property
    def kept_up(self) -> bool:
        return self.registered_per_s >= KEEP_UP * self.queued_registrations_per_s

    @property
    def generator_kept_up(self) -> bool:
        return self.lookups_per_s >= GENERATOR_KEEP_UP * self.scheduled_lookups_per_s

    def params(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def _connection_room(url: str) -> int:
    """Connections the server can still open for nodes (its limit, less the superusers' reserve,
    less those open now, less a few for the bench itself)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        limit = int(conn.execute("SHOW max_connections").fetchone()[0])
        reserved = int(conn.execute("SHOW superuser_reserved_connections").fetchone()[0])
        in_use = int(
            conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()[0]
        )
    return limit - reserved - in_use - 4


def _nodes_room(endpoints: Endpoints) -> int:
    """Nodes whose clients the servers can still connect: each holds a writer on `write_url` and
    a reader on `read_url`."""
    if endpoints.read_url == endpoints.write_url:
        return _connection_room(endpoints.write_url) // CONNECTIONS_PER_NODE
    # With a replica the primary still holds the writer and a reader (the staleness probe's, and
    # the reads' fallback); the standby one reader.
    return min(_connection_room(endpoints.write_url) // CONNECTIONS_PER_NODE, _connection_room(endpoints.read_url))


def _ramp(limit: int) -> Iterator[int]:
    """1, 2, 4, ... up to `limit`, ending at `limit` itself when the doubling passes it."""
    nodes = 1
    while nodes < limit:
        yield nodes
        nodes *= 2
    if limit >= 1:
        yield limit


def _heartbeat(names: list[str]) -> None:
    from controlplane.directory.services import TierReport, node_heartbeat

    for name in names:
        node_heartbeat(
            name=name,
            host="bench-fleet",
            heartbeat_seconds=3600.0,
            tiers=[TierReport(tier="host", capacity_bytes=1 << 40, used_bytes=0)],
        )


def _step(
    setup: str,
    endpoints: Endpoints,
    nodes: int,
    *,
    processes: int,
    offered: dict[str, Any],
    chains: list[dict[str, Any]],
    warmup_s: float,
    window_s: float,
    windows: int,
) -> Step:
    """Run `nodes` simulated nodes over `processes` worker processes for a warm-up and `windows`
    measured windows; the medians of the windows' figures."""
    workers = min(processes, nodes)
    start_at = time.time() + 3.0 + 0.05 * nodes  # room for the workers to import and connect
    specs = []
    for w in range(workers):
        names = [f"fleet-{i}" for i in range(w, nodes, workers)]
        specs.append(
            {
                "setup": setup,
                "endpoints": dataclasses.asdict(endpoints),
                "nodes": names,
                "offered": offered,
                "chains": chains,
                "start_at": start_at,
                "warmup_s": warmup_s,
                "window_s": window_s,
                "windows": windows,
                "seed": nodes * 1000 + w,
            }
        )
    children = []
    for spec in specs:
        # The spec (thousands of keys) goes on stdin: too long for a command line.
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.suites.directory_fleet", "--nodes"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps(spec))
        process.stdin.close()
        children.append(process)
    machine = []
    for k in range(windows + 1):
        delay = start_at + warmup_s + k * window_s - time.time()
        if delay > 0:
            time.sleep(delay)
        machine.append(machine_jiffies() or (0.0, 0.0))
    reports = []
    for process in children:
        out = process.stdout.read() if process.stdout else ""
        if process.wait() != 0:
            raise RuntimeError(f"a fleet worker failed (exit {process.returncode}) at {nodes} nodes")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    cpus = os.cpu_count() or 1
    per_window: dict[str, list[float]] = {}
    for k in range(windows):
        latencies = [ms for r in reports for ms in r["windows"][k]["latencies_ms"]]
        failures = sum(r["windows"][k]["lookup_failures"] for r in reports)
        latencies += [math.inf] * failures
        busy = machine[k + 1][0] - machine[k][0]
        total = machine[k + 1][1] - machine[k][1]
        figures = {
            "p50": _percentile(latencies, 50) if latencies else math.inf,
            "p99": _percentile(latencies, 99) if latencies else math.inf,
            "lookups": len(latencies) / window_s,
            "scheduled": sum(r["windows"][k]["scheduled"] for r in reports) / window_s,
            "registered": sum(r["windows"][k]["registered"] for r in reports) / window_s,
            "queued": sum(r["windows"][k]["queued"] for r in reports) / window_s,
            "generator": sum(r["windows"][k]["cpu_s"] for r in reports) / window_s,
            "machine": cpus * busy / total if total else 0.0,
        }
        for name, value in figures.items():
            per_window.setdefault(name, []).append(value)
    median = {name: statistics.median(values) for name, values in per_window.items()}
    return Step(
        nodes=nodes,
        lookup_p50_ms=median["p50"],
        lookup_p99_ms=median["p99"],
        lookups_per_s=median["lookups"],
        offered_lookups_per_s=nodes * offered["requests_per_s"],
        scheduled_lookups_per_s=median["scheduled"],
        registered_per_s=median["registered"],
        queued_registrations_per_s=median["queued"],
        offered_registrations_per_s=nodes * offered["requests_per_s"] * offered["blocks_saved_per_request"],
        backlog=sum(r["backlog"] for r in reports),
        lookup_failures=sum(w["lookup_failures"] for r in reports for w in r["windows"]),
        dropped_touches=sum(r["dropped_touches"] for r in reports),
        generator_cores=median["generator"],
        machine_busy_cores=median["machine"],
        replica_read_share=(
            sum(r["replica_reads"] for r in reports)
            / max(1, sum(r["replica_reads"] + r["primary_reads"] for r in reports))
        ),
    )


def _ramp_setup(
    setup: Setup, endpoints: Endpoints, *, max_nodes: int, registered: set[str], step: Callable[[int], Step]
) -> tuple[list[Step], str]:
    """The steps of one setup's ramp, up to the first that misses, and what ended the ramp."""
    steps: list[Step] = []
    room = _nodes_room(endpoints)
    limited_by = f"STRATA_BENCH_FLEET_MAX_NODES ({max_nodes})"
    if room < max_nodes:
        limited_by = f"connections: the server has room for {room} nodes' clients"
    for nodes in _ramp(min(max_nodes, room)):
        names = [f"fleet-{i}" for i in range(nodes) if f"fleet-{i}" not in registered]
        _heartbeat(names)
        registered.update(names)
        measured = step(nodes)
        steps.append(measured)
        _emit(
            step=f"{setup.name} {nodes} nodes: p99 {measured.lookup_p99_ms:.2f} ms, "
            f"{measured.registered_per_s:.0f}/{measured.queued_registrations_per_s:.0f} registrations/s"
        )
        _emit(log=f"directory_fleet {setup.name}: {json.dumps(measured.params())}")
        if not measured.generator_kept_up:
            return steps, (
                f"the load generator: {measured.lookups_per_s:.0f} of {measured.scheduled_lookups_per_s:.0f} "
                f"requests/s sent at {nodes} nodes, the machine {measured.machine_busy_cores:.2f} of "
                f"{os.cpu_count()} cores busy"
            )
        if measured.lookup_failures or measured.lookup_p99_ms > LOOKUP_P99_CEILING_MS:
            return steps, (
                f"lookups: p99 {measured.lookup_p99_ms:.2f} ms, {measured.lookup_failures} failed, at {nodes} nodes"
            )
        if not measured.kept_up:
            return steps, (
                f"registrations: {measured.registered_per_s:.0f} of {measured.queued_registrations_per_s:.0f}/s "
                f"at {nodes} nodes"
            )
    return steps, limited_by


def child(spec: dict[str, Any]) -> None:
    import django

    django.setup()
    from django.core.management import call_command

    from worker.postgres_directory import django_connect

    scale, repeats = spec["scale"], spec["repeats"]
    # A step: a warm-up, then `repeats` windows long enough for a stable p99 of the fleet's lookups.
    window_s = min(20.0, max(3.0, 20.0 * scale))
    warmup_s = min(5.0, max(1.0, 5.0 * scale))
    setups = [setup for setup in SETUPS if setup.name in spec["setups"]]
    _emit(plan=3 + len(setups) * 8)
    call_command("migrate", verbosity=0, interactive=False)
    _emit(step="migrated")
    world = World(spec["blocks"])
    _scope(world)
    seconds = _seed(world, django_connect())
    _emit(step=f"seeded {world.blocks} blocks in {seconds:.0f}s")
    rng = random.Random(20261206)
    chains = []
    for chain in rng.sample(range(world.chains), min(SAMPLE_CHAINS, world.chains)):
        ns, model = world.chain_scope(chain)
        chains.append(
            {
                "namespace": world.namespace_names[ns],
                "model_key": str(world.model_keys[model]),
                "keys": [str(world.prefix_key(chain * CHAIN + b)) for b in range(CHAIN)],
            }
        )
    offered = spec["offered"]
    common = {
        "blocks": world.blocks,
        "window_s": window_s,
        "windows": repeats,
        "warmup_s": warmup_s,
        **Offered(**offered).params(),
    }
    registered: set[str] = set()
    for setup in setups:
        with setup.provision(spec["url"]) as endpoints:
            steps, limited_by = _ramp_setup(
                setup,
                endpoints,
                max_nodes=spec["max_nodes"],
                registered=registered,
                step=functools.partial(
                    _step,
                    setup.name,
                    endpoints,
                    processes=spec["processes"],
                    offered=offered,
                    chains=chains,
                    warmup_s=warmup_s,
                    window_s=window_s,
                    windows=repeats,
                ),
            )
        passing = [s for s in steps if s.within_target and s.kept_up and s.generator_kept_up]
        best = passing[-1] if passing else None
        for step in steps:
            prefix = f"directory_fleet.{setup.name}.n{step.nodes}"
            params = {"setup": setup.describe, **step.params(), **common}
            _row(f"{prefix}.lookup_p50_ms", step.lookup_p50_ms, "ms", **params)
            _row(f"{prefix}.lookup_p99_ms", step.lookup_p99_ms, "ms", **params)
            _row(f"{prefix}.registered_per_s", step.registered_per_s, "blocks/s", **params)
        _row(
            f"directory_fleet.{setup.name}.max_nodes",
            best.nodes if best else 0,
            "nodes",
            setup=setup.describe,
            limited_by=limited_by,
            at_max=best.params() if best else None,
            steps=[s.params() for s in steps],
            **common,
        )
        _emit(param={f"{setup.name}_limited_by": limited_by})


# -- a worker process: some of the fleet's nodes ----------------------------------------------------


def _client(endpoints: Endpoints) -> Any:
    """One node's directory client on `endpoints`, with the node's default options."""
    import psycopg

    from worker.dataplane.network import ConnectionOptions
    from worker.postgres_directory import DirectoryOptions, PostgresDirectory
    from worker.postgres_replica import ReplicaOptions

    options = DirectoryOptions()
    if endpoints.read_url != endpoints.write_url:
        options = DirectoryOptions(replica=ReplicaOptions(url=endpoints.read_url, max_lag_s=1.0, probe_s=0.2))
    libpq = ConnectionOptions().libpq()
    return PostgresDirectory(
        connect=lambda: psycopg.connect(endpoints.write_url, **libpq),
        options=options,
        announce=lambda **_: None,
        source="bench-fleet",
    )


class _Node:
    """One simulated node: its client, and a thread sending its requests at Poisson arrivals."""

    def __init__(self, name: str, spec: dict[str, Any], rng: random.Random, windows: list[tuple[float, float]]) -> None:
        self.name = name
        self.spec = spec
        self.rng = rng
        self.windows = windows
        self.client = _client(Endpoints(**spec["endpoints"]))
        self.latencies_ms: list[list[float]] = [[] for _ in windows]
        self.failures = [0 for _ in windows]
        self.enqueued = [0 for _ in windows]
        self.scheduled = [0 for _ in windows]
        self.position = 0
        self.thread = threading.Thread(target=self._run, name=f"node-{name}", daemon=True)

    def _count(self, value: float) -> int:
        """`value` rounded up or down at random, so the mean over requests is `value`."""
        whole = math.floor(value)
        return whole + (1 if self.rng.random() < value - whole else 0)

    def _window(self, at: float) -> int | None:
        for k, (begin, end) in enumerate(self.windows):
            if begin <= at < end:
                return k
        return None

    def _run(self) -> None:
        from worker.dataplane.directory import BlockRegistration, BlockTouch, DirectoryUnavailable

        offered = self.spec["offered"]
        chains = self.spec["chains"]
        end = self.windows[-1][1]
        due = self.spec["start_at"]
        while True:
            due += self.rng.expovariate(offered["requests_per_s"])
            if due >= end:
                return
            k = self._window(due)
            if k is not None:
                self.scheduled[k] += 1
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            chain = chains[self.rng.randrange(len(chains))]
            model_key = uuid.UUID(chain["model_key"])
            keys_count = max(1, self._count(offered["keys_per_lookup"]))
            hits = [uuid.UUID(k) for k in chain["keys"][: min(keys_count, self._count(offered["touches_per_request"]))]]
            keys = hits + [uuid.uuid4() for _ in range(keys_count - len(hits))]
            sent_at, began = time.time(), time.perf_counter()
            try:
                self.client.lookup(keys=keys, node=self.name, namespace=chain["namespace"], model_key=model_key)
                failed = False
            except DirectoryUnavailable:
                failed = True
            took_ms = (time.perf_counter() - began) * 1e3
            k = self._window(sent_at)
            if k is not None:
                if failed:
                    self.failures[k] += 1
                else:
                    self.latencies_ms[k].append(took_ms)
            if hits:
                now = time.time()
                self.client.touch(
                    touches=[
                        BlockTouch(namespace=chain["namespace"], model_key=model_key, prefix_key=h, at=now)
                        for h in hits
                    ]
                )
            saved = self._count(offered["blocks_saved_per_request"])
            if saved:
                blocks = []
                for _ in range(saved):
                    blocks.append(
                        BlockRegistration(
                            namespace=chain["namespace"],
                            model_key=model_key,
                            prefix_key=uuid.uuid4(),
                            content_key=uuid.uuid4(),
                            position=BLOCK_TOKENS * (self.position % CHAIN),
                            tokens=BLOCK_TOKENS,
                            tier="host",
                            node=self.name,
                            nbytes=33554432,
                        )
                    )
                    self.position += 1
                self.client.register(blocks=blocks)
                k = self._window(time.time())
                if k is not None:
                    self.enqueued[k] += saved


def drive_nodes(spec: dict[str, Any]) -> None:
    """Drive `spec["nodes"]`; print one JSON line: per window the lookup latencies, failures,
    registrations the directory took and CPU seconds this process used, then the backlog left."""
    import django

    django.setup()  # the node's client runs the control plane's SQL (node_api), as inside a node
    rng = random.Random(spec["seed"])
    begin = spec["start_at"] + spec["warmup_s"]
    windows = [(begin + k * spec["window_s"], begin + (k + 1) * spec["window_s"]) for k in range(spec["windows"])]
    nodes = [_Node(name, spec, random.Random(rng.random()), windows) for name in spec["nodes"]]
    for node in nodes:
        node.thread.start()
    pending, cpu = [], []
    for at in [w[0] for w in windows] + [windows[-1][1]]:
        delay = at - time.time()
        if delay > 0:
            time.sleep(delay)
        pending.append(sum(node.client.stats().pending for node in nodes))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(usage.ru_utime + usage.ru_stime)
    for node in nodes:
        node.thread.join()
    report_windows = []
    for k in range(len(windows)):
        enqueued = sum(node.enqueued[k] for node in nodes)
        report_windows.append(
            {
                "latencies_ms": [ms for node in nodes for ms in node.latencies_ms[k]],
                "lookup_failures": sum(node.failures[k] for node in nodes),
                # Taken by the directory: what the nodes queued, less what the queues grew by.
                "registered": enqueued - (pending[k + 1] - pending[k]),
                "queued": enqueued,
                "scheduled": sum(node.scheduled[k] for node in nodes),
                "cpu_s": cpu[k + 1] - cpu[k],
            }
        )
    backlog = pending[-1]
    totals = {"dropped_touches": 0, "replica_reads": 0, "primary_reads": 0}
    for node in nodes:
        stats = node.client.stats()
        for name in totals:
            totals[name] += getattr(stats, name)
        node.client.close(timeout=30)
    print(json.dumps({"windows": report_windows, "backlog": backlog, **totals}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--nodes":
        drive_nodes(json.loads(sys.stdin.read()))
    else:
        child(json.loads(sys.argv[1]))
