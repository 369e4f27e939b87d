"""Suite `directory`: batched hit detection and registration against a directory of 1M blocks
(10M with ``--scale 10``, as ``make bench-scale`` runs it).

The suite creates its own database (``strata_bench_directory_<pid>``) on the configured PostgreSQL
server (the embedded one unless DATABASE_URL says otherwise), migrates it, seeds it with COPY
(secondary indexes dropped during the load and rebuilt after, as one would restore a dump), then
measures in a child process whose Django points at that database:

* ``lookup64`` / ``lookup1024``: the ``blocks_lookup`` selector (one SQL round trip on Django's
  connection) for a prompt of 64 (1024) prefix keys: the first three quarters are blocks of one
  registered chain, the rest misses. Chains are picked uniformly at random over the whole table.
* ``node_lookup64``: the same through the node's Directory client (its own connection,
  server-side binding, prepared statement).
* ``node_role_lookup64``: the node's Directory client on the node's own role
  (``strata_node_credential``: grants and row-level security), as nodes run.
* ``rest_lookup64``: ``POST /api/v1/blocks/lookup/`` through the engine API server as deployed
  (gunicorn, ``controlplane.runtime.gunicorn``: WSGI, threaded workers; token auth, role check,
  throttling, JSON) over a keep-alive HTTP connection, with the project's production settings (a
  pool of database connections); ``rest_asgi_lookup64`` the same through daphne (ASGI, the server
  that also carries the dashboard's websockets); ``rest_unpooled_lookup64`` through daphne with
  ``STRATA_DB_POOL_MAX=0`` (a new database connection per request), to show what the pool saves.
* ``register``: the ``blocks_register`` service, 4096 new blocks (with one copy each) per call,
  and the WAL the server wrote per block meanwhile (``register_burst_wal``: a burst of 40 calls,
  whatever the checkpoints did before it); ``register_2writers``: two callers at once, each on its
  own connection (several nodes flushing together); ``register_4writers``: four processes at once,
  right after a CHECKPOINT, registering a fifth of the directory's size between them: their rate,
  and ``register_wal``, the WAL per block over that stretch, split into full-page images and the
  records themselves (pg_walinspect, where the server has it). After a checkpoint the first change
  to each page logs the whole page; with keys that are hashes every index page of the two key
  indexes is touched again soon, so a short burst pays an image of most of those pages and a long
  stretch spreads them over many blocks: the figure over the stretch is an upper bound of the
  average over a whole checkpoint cycle at that rate. The CPU time per block over the stretch,
  the machine's (every process's, from /proc/stat) less the writers' own, says how many of the
  database server's cores a rate needs; ``writebehind``: the same blocks
  through the Directory client, enqueue to durable; ``node_role_writebehind`` on the node's own
  role (row-level security checks every copy's node).

The database is dropped at the end (``STRATA_BENCH_KEEP_DB=1`` keeps it). EXPLAIN (ANALYZE,
BUFFERS) of a 64-key lookup, of a touch batch and (with WAL) of the two statements registering
4096 new blocks, at full size, goes to the log and the results.

The server's settings are its own: the embedded one sizes its shared buffers and checkpoints for
this workload (controlplane.runtime.embedded.server_settings) when it starts; one already running
with other settings keeps them until it restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DESCRIPTION = "directory hit detection (service, node client, REST) and registration at 1M blocks (--scale 10: 10M)"
EXPECTED_ROWS = (
    "directory.lookup64_p50_ms",
    "directory.node_lookup64_p50_ms",
    "directory.rest_lookup64_p99_ms",
    "directory.register_blocks_per_s",
    "directory.writebehind_blocks_per_s",
)
"""Lookups through the service, a node's client and REST; registration, direct and write-behind."""

FULL_BLOCKS = 1_000_000
CHAIN = 64
"""Blocks per seeded chain (a 16K-token prompt of 256-token blocks)."""
NAMESPACES = 8
MODELS = 2
BENCH_DB_PREFIX = "strata_bench_directory"
REPO_ROOT = Path(__file__).resolve().parents[2]

TARGETS = {
    "directory.lookup64_p99_ms": "target <= 2 ms at 10M blocks",
    "directory.rest_lookup64_p99_ms": "target <= 15 ms at 10M blocks",
    "directory.register_blocks_per_s": "target >= 50K blocks/s",
    "directory.register_4writers_blocks_per_s": "target >= 100K blocks/s at 10M blocks",
    "directory.register_wal_bytes_per_block": "target <= 1500 bytes at 10M blocks",
}
WRITERS = 4
"""Processes registering at once in the `register_4writers` row."""
SUSTAINED_SHARE = 0.2
"""Blocks the four writers register after the checkpoint, as a share of the seeded directory."""


# -- the harness side ------------------------------------------------------------------------------


def run(ctx: Any) -> list[Any]:
    from benchmarks.harness import run_child
    from benchmarks.runtime.database import django_child_env, scratch_database

    # At least twice the chains a 16-chain prompt spans across every namespace and model.
    blocks = max(CHAIN * NAMESPACES * MODELS * 32, int(FULL_BLOCKS * ctx.scale) // CHAIN * CHAIN)
    spec = {"blocks": blocks, "repeats": ctx.repeats, "scale": ctx.scale, "scratch": str(ctx.scratch)}
    # One database per run, so two runs at once (two engineers, one server) never drop each other's.
    name = f"{BENCH_DB_PREFIX}_{os.getpid()}"
    ctx.params.update(blocks=blocks, database=name)
    with scratch_database(name) as url:
        env = django_child_env(url)
        rows = run_child(ctx, "benchmarks.suites.directory", spec, env, notes=TARGETS)
    return rows


# -- the child process (Django configured for the bench database) --------------------------------


def _emit(**message: Any) -> None:
    print(json.dumps(message), flush=True)


def _row(name: str, value: float, unit: str, **params: Any) -> None:
    _emit(row={"name": name, "value": round(value, 4), "unit": unit, "params": params})


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(pct / 100 * (len(ordered) - 1))))]


class World:
    """The seeded directory: which chain is where, and the keys to ask for."""

    def __init__(self, blocks: int, seed: int = 20261129) -> None:
        import numpy as np

        self.blocks = blocks
        self.chains = blocks // CHAIN
        rng = np.random.default_rng(seed)
        self.prefix = rng.bytes(16 * blocks)
        self.content = rng.bytes(16 * blocks)
        self.rng = rng
        self.namespace_names = [f"bench-{i}" for i in range(NAMESPACES)]
        self.model_keys: list[uuid.UUID] = []
        self.namespace_ids: list[int] = []
        self.model_ids: list[int] = []
        self.node_ids: dict[str, int] = {}

    def chain_scope(self, chain: int) -> tuple[int, int]:
        """(namespace index, model index) of a chain."""
        return chain % NAMESPACES, (chain // NAMESPACES) % MODELS

    def prefix_key(self, block: int) -> uuid.UUID:
        return uuid.UUID(bytes=self.prefix[16 * block : 16 * block + 16])

    def prompt(self, chains: int) -> tuple[str, uuid.UUID, list[uuid.UUID]]:
        """Keys of a prompt spanning `chains` chains of one namespace and model: three quarters
        registered blocks, then misses."""
        first = int(self.rng.integers(0, self.chains - NAMESPACES * MODELS * chains))
        picked = [first + i * NAMESPACES * MODELS for i in range(chains)]
        keys = [self.prefix_key(c * CHAIN + b) for c in picked for b in range(CHAIN)]
        hits = len(keys) * 3 // 4
        keys = keys[:hits] + [uuid.uuid4() for _ in range(len(keys) - hits)]
        ns, model = self.chain_scope(first)
        return self.namespace_names[ns], self.model_keys[model], keys


def _scope(world: World) -> None:
    from controlplane.directory.services import (
        TierReport,
        modelprofile_create,
        namespace_create,
        node_heartbeat,
    )

    for name in world.namespace_names:
        world.namespace_ids.append(namespace_create(name=name).id)
    for i in range(MODELS):
        profile = modelprofile_create(
            name=f"bench-model-{i}",
            model_id=f"bench/llama-{i}",
            layers=32,
            kv_heads=8,
            head_dim=128,
            dtype="bfloat16",
            block_tokens=256,
        )
        world.model_keys.append(profile.model_key)
        world.model_ids.append(profile.id)
    for name in ("gpu-0", "gpu-1"):
        node = node_heartbeat(
            name=name,
            host="bench",
            heartbeat_seconds=3600.0,
            tiers=[TierReport(tier="host", capacity_bytes=1 << 40, used_bytes=0)],
        )
        world.node_ids[name] = node.id


def _secondary(conn: Any, table: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Unique and foreign-key constraints, and plain indexes, of a table (not its primary key)."""
    constraints = conn.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype IN ('u', 'f')",
        (table,),
    ).fetchall()
    indexes = conn.execute(
        "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "WHERE i.indrelid = %s::regclass AND NOT i.indisprimary "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)",
        (table,),
    ).fetchall()
    return [(name, definition) for name, definition in constraints], [row[0] for row in indexes]


def _seed(world: World, connect: Callable[[], Any]) -> float:
    """COPY the blocks and their copies in; returns the seconds it took (indexes rebuilt included)."""
    started = time.perf_counter()
    conn = connect()
    conn.autocommit = True
    saved = {}
    for table in ("directory_placement", "directory_block"):
        constraints, indexes = _secondary(conn, table)
        saved[table] = (constraints, indexes)
        for name, _ in constraints:
            conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
        for definition in indexes:
            name = definition.split(" INDEX ", 1)[1].split(" ON ", 1)[0]
            conn.execute(f"DROP INDEX {name}")
    tiers = [
        ("host", world.node_ids["gpu-0"]),
        ("disk", world.node_ids["gpu-0"]),
        ("remote", None),
        ("host", world.node_ids["gpu-1"]),
    ]
    base = time.time() - 86400 * 30
    chunk = 100_000
    access = world.rng.zipf(1.6, size=world.blocks) % 10_000
    prefix_hex, content_hex = world.prefix.hex(), world.content.hex()
    placement_id = 0
    with conn.cursor() as cur:
        with cur.copy(
            "COPY directory_block (id, namespace_id, model_id, prefix_key, content_key, position, "
            "token_count, size_bytes, priority, created_at, last_access_at, access_count) FROM STDIN"
        ) as copy:
            for start in range(0, world.blocks, chunk):
                lines = []
                for i in range(start, min(start + chunk, world.blocks)):
                    ns, model = world.chain_scope(i // CHAIN)
                    created = base + i * 0.001
                    lines.append(
                        f"{i + 1}\t{world.namespace_ids[ns]}\t{world.model_ids[model]}\t"
                        f"{prefix_hex[32 * i : 32 * i + 32]}\t{content_hex[32 * i : 32 * i + 32]}\t"
                        f"{(i % CHAIN) * 256}\t256\t33554432\tdefault\t{_ts(created)}\t"
                        f"{_ts(created + 60)}\t{access[i]}\n"
                    )
                copy.write("".join(lines))
        with cur.copy(
            'COPY directory_placement (id, block_id, tier, node_id, locator, "offset", size_bytes, '
            "checksum, state, epoch, updated_at) FROM STDIN"
        ) as copy:
            for start in range(0, world.blocks, chunk):
                lines = []
                for i in range(start, min(start + chunk, world.blocks)):
                    copies = [tiers[i % 4]]
                    if i % 10 == 0 and i % 4 != 2:
                        copies.append(("remote", None))
                    for tier, node in copies:
                        placement_id += 1
                        lines.append(
                            f"{placement_id}\t{i + 1}\t{tier}\t{node if node else chr(92) + 'N'}\t\t0\t"
                            f"33554432\t{prefix_hex[32 * i : 32 * i + 32]}\tready\t1\t{_ts(base)}\n"
                        )
                copy.write("".join(lines))
    conn.execute("SET maintenance_work_mem = '512MB'")
    for table in ("directory_block", "directory_placement"):
        constraints, indexes = saved[table]
        for name, definition in constraints:
            conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}')
        for definition in indexes:
            conn.execute(definition)
        conn.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
        conn.execute(f"VACUUM (ANALYZE) {table}")
    # As after restoring a dump: the seed's gigabytes of dirty buffers written out now, not by the
    # checkpointer in the background while the lookups are timed.
    conn.execute("CHECKPOINT")
    conn.close()
    return time.perf_counter() - started


def _ts(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1e6) % 1_000_000:06d}+00"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _server(kind: str, *, pooled: bool) -> Iterator[int]:
    """The control plane served with the production settings by the engine API's gunicorn
    ("wsgi") or by daphne ("asgi"): with their connection pool, or without it (each request
    then opens a new database connection)."""
    port = _free_port()
    env = {**os.environ, "STRATA_DB_POOL_MAX": os.environ.get("STRATA_DB_POOL_MAX", "8") if pooled else "0"}
    if kind == "wsgi":
        command = [
            "-m",
            "gunicorn",
            "-c",
            "python:controlplane.runtime.gunicorn",
            "-b",
            f"127.0.0.1:{port}",
            "controlplane.wsgi:application",
        ]
    else:
        command = ["-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"]
    server = subprocess.Popen(
        [sys.executable, *command], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{kind} server exited: {server.stderr.read() if server.stderr else ''}")
            with contextlib.suppress(OSError):
                probe = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                probe.request("GET", "/livez")
                if probe.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} server did not answer /livez within 60 s")
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _engine_token() -> str:
    from django.contrib.auth.models import Group, User
    from rest_framework.authtoken.models import Token

    user = User.objects.create_user(username="bench-engine", password=secrets.token_urlsafe(16))
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    return Token.objects.create(user=user).key


def _explain(world: World) -> None:
    from django.db import connection, transaction
    from django.utils import timezone

    from controlplane.directory import queries

    namespace, model_key, keys = world.prompt(1)
    with connection.cursor() as cursor:
        plan = queries.explain(
            cursor,
            queries.LOOKUP_SQL,
            queries.lookup_params(
                namespace=namespace, model_key=model_key, node="gpu-0", prefix_keys=keys, content_keys=[]
            ),
        )
        with transaction.atomic():
            rows = [
                queries.TouchRow(namespace=namespace, model_key=model_key, prefix_key=key, hits=1, at=timezone.now())
                for key in keys
            ]
            touch = queries.explain(cursor, queries.TOUCH_SQL, queries.touch_params(rows))
            transaction.set_rollback(True)
        register_blocks, register_copies = _explain_register(world, cursor)
    for name, text in (
        ("lookup64", plan),
        ("touch64", touch),
        ("register4096_blocks", register_blocks),
        ("register4096_copies", register_copies),
    ):
        _emit(log=f"EXPLAIN (ANALYZE, BUFFERS) {name} at {world.blocks} blocks:\n{text}")
        _emit(param={f"explain_{name}": text})
        if "Seq Scan on directory_block" in text or "Seq Scan on directory_placement" in text:
            _emit(log=f"WARNING: {name} plan has a sequential scan")


def _wal_position() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()::text")
        return str(cursor.fetchone()[0])


def _wal_bytes_since(position: str) -> int:
    """WAL the server wrote since `position` (every session's, and the bench is the only writer)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [position])
        return int(cursor.fetchone()[0])


def _explain_register(world: World, cursor: Any) -> tuple[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS, WAL) of the two statements that register 4096 new blocks (rolled
    back): the buffers each row touches and the WAL it writes, index by index."""
    from django.db import transaction
    from django.utils import timezone

    from controlplane.directory import queries

    namespace = world.namespace_names[0]
    regs = [_registration(namespace, world.model_keys[0], i) for i in range(4096)]
    now = timezone.now()
    with transaction.atomic():
        scope = queries.resolve(cursor, namespaces=[namespace], model_keys=[world.model_keys[0]], nodes=["gpu-0"])
        rows, _ = queries.registration_rows(scope, regs)
        params = queries.register_params(rows, now)
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF) " + queries.REGISTER_BLOCKS_SQL, params)
        blocks = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute(
            "SELECT id FROM directory_block WHERE prefix_key = ANY(%s::uuid[]) ORDER BY id", [params["prefix_keys"]]
        )
        created = {row[0] for row in cursor.fetchall()}
        cursor.execute(
            "SELECT prefix_key, id FROM directory_block WHERE id = ANY(%s::bigint[])", [queries.ints(created)]
        )
        ids = dict(cursor.fetchall())
        params["new_block_ids"] = queries.ints(ids[row.prefix_key] for row in rows)
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF) " + queries.REGISTER_NEW_PLACEMENTS_SQL, params)
        copies = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return blocks, copies


def _registration(namespace: str, model_key: uuid.UUID, i: int, **extra: Any) -> Any:
    """A new block (fresh random keys) at position `i` of its chain, with one host copy on gpu-0."""
    from worker.dataplane.directory import BlockRegistration

    return BlockRegistration(
        namespace=namespace,
        model_key=model_key,
        prefix_key=uuid.uuid4(),
        content_key=uuid.uuid4(),
        position=256 * (i % CHAIN),
        tokens=256,
        tier="host",
        node="gpu-0",
        nbytes=33554432,
        **extra,
    )


def _writer_process(namespace: str, model_key: str, batches: int, barrier: Any, failures: Any, cpu: Any) -> None:
    """One of `register_4writers`' processes: builds its registrations, waits for the others,
    then calls `blocks_register` once per batch of 4096 on its own connection; puts the CPU
    seconds those calls took in `cpu`."""
    import django

    django.setup()
    from django.db import connection

    from controlplane.directory.services import blocks_register

    calls = [
        [_registration(namespace, uuid.UUID(model_key), i, checksum=secrets.token_hex(16)) for i in range(4096)]
        for _ in range(batches)
    ]
    try:
        connection.ensure_connection()
        barrier.wait(timeout=600)
        began = time.process_time()
        for regs in calls:
            blocks_register(registrations=regs, source="bench")
        cpu.put(time.process_time() - began)
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        failures.put(f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()


@dataclasses.dataclass(frozen=True)
class Written:
    """What `_writers` measured."""

    blocks: int
    seconds: float
    machine_cpu_s: float | None
    """CPU time of every process on the machine meanwhile (None off Linux)."""
    writers_cpu_s: float
    """CPU time of the registering processes themselves (their Python and psycopg)."""


def _writers(world: World, ns_index: int, writers: int, batches: int) -> Written:
    """`writers` processes registering at once, each `batches` calls of 4096 new blocks on its
    own connection (a fleet's nodes flushing together, each caller's Python on its own core
    where there is one): the time from their common start to the last one's end, and the CPU
    the machine and they used meanwhile."""
    import multiprocessing
    import queue

    from django.db import connections

    connections.close_all()
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(writers + 1)
    failures = spawn.Queue()
    cpu = spawn.Queue()
    processes = [
        spawn.Process(
            target=_writer_process,
            args=(world.namespace_names[ns_index], str(world.model_keys[w % MODELS]), batches, barrier, failures, cpu),
        )
        for w in range(writers)
    ]
    for process in processes:
        process.start()
    try:
        barrier.wait(timeout=600)
        machine_before = _cpu_seconds()
        began = time.perf_counter()
        for process in processes:
            process.join()
        elapsed = time.perf_counter() - began
        machine_after = _cpu_seconds()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    with contextlib.suppress(queue.Empty):
        raise RuntimeError(f"a registering process failed: {failures.get(timeout=1)}")
    if any(process.exitcode for process in processes):
        raise RuntimeError(f"a registering process exited with {[p.exitcode for p in processes]}")
    return Written(
        blocks=writers * batches * 4096,
        seconds=elapsed,
        machine_cpu_s=None if machine_before is None or machine_after is None else machine_after - machine_before,
        writers_cpu_s=sum(cpu.get(timeout=10) for _ in processes),
    )


def machine_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU jiffies of the whole machine since boot, every process's (/proc/stat:
    user to steal; busy is all but idle and iowait), or None off Linux."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    total = sum(fields)
    return total - fields[3] - fields[4], total


def _cpu_seconds() -> float | None:
    """CPU seconds every process of this machine has used since boot, or None off Linux."""
    jiffies = machine_jiffies()
    return None if jiffies is None else jiffies[0] / os.sysconf("SC_CLK_TCK")


def _checkpoint() -> str:
    """A CHECKPOINT, then the WAL position: what follows pays the full-page images of a new cycle."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")
    return _wal_position()


def _wal_images(start: str) -> int | None:
    """Bytes of full-page images in the WAL since `start` (pg_walinspect), or None where the
    server lacks the extension, the role may not read WAL, or the segments were recycled."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            cursor.execute(
                "SELECT coalesce(sum(fpi_size), 0) FROM pg_get_wal_stats(%s::pg_lsn, pg_current_wal_lsn())", [start]
            )
            return int(cursor.fetchone()[0])
    except Exception as exc:  # noqa: BLE001 - the split is optional; the total is measured anyway
        _emit(log=f"no full-page image split of the WAL: {exc}")
        return None


def _two_writers(world: World, ns_index: int, batches: int) -> float:
    """Blocks per second registered by two threads at once, each with its own database
    connection and `batches` calls of 4096 new blocks: what the directory takes when several
    nodes' write-behind clients flush together, without the client's own Python time."""
    import threading

    from django.db import connection

    from controlplane.directory.services import blocks_register

    work = [
        [
            [
                _registration(world.namespace_names[ns_index], world.model_keys[w], i, checksum=secrets.token_hex(16))
                for i in range(4096)
            ]
            for _ in range(batches)
        ]
        for w in range(2)
    ]
    ready = threading.Barrier(3)
    failures: list[BaseException] = []

    def writer(calls: list[list[Any]]) -> None:
        try:
            ready.wait()
            for regs in calls:
                blocks_register(registrations=regs, source="bench")
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(calls,)) for calls in work]
    for thread in threads:
        thread.start()
    ready.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return 2 * batches * 4096 / (time.perf_counter() - began)


def child(spec: dict[str, Any]) -> None:
    import django

    django.setup()
    import psycopg
    from django.core.management import call_command

    from controlplane.directory.selectors import blocks_lookup
    from controlplane.directory.services import blocks_register
    from controlplane.directory.services.credentials import node_credential_create
    from worker.postgres_directory import DirectoryOptions, PostgresDirectory, django_connect

    repeats = spec["repeats"]
    small = spec["scale"] < 0.1
    n64, n1024, nrest, batches = (300, 40, 200, 8) if small else (2000, 200, 1000, 40)
    sustained_batches = max(batches // WRITERS, -(-int(spec["blocks"] * SUSTAINED_SHARE) // (WRITERS * 4096)))
    _emit(plan=4 + 4 * repeats)
    call_command("migrate", verbosity=0, interactive=False)
    _emit(step="migrated")
    world = World(spec["blocks"])
    _scope(world)
    seconds = _seed(world, django_connect())
    _row("directory.seed_blocks_per_s", world.blocks / seconds, "blocks/s", blocks=world.blocks)
    _emit(step=f"seeded {world.blocks} blocks in {seconds:.0f}s")
    token = _engine_token()
    node = PostgresDirectory(options=DirectoryOptions(), announce=lambda **_: None, source="bench")
    # The same client on the node's own role (grants and row-level security, as nodes run).
    credential = node_credential_create(node="gpu-0")
    own = PostgresDirectory(
        connect=lambda: psycopg.connect(credential.database_url, connect_timeout=2),
        options=DirectoryOptions(),
        announce=lambda **_: None,
        source="bench",
    )
    for _ in range(200):  # warm the plan caches and a share of the buffers
        ns, mk, keys = world.prompt(1)
        blocks_lookup(namespace=ns, model_key=mk, node="gpu-0", prefix_keys=keys)
        node.lookup(keys=keys, node="gpu-0", namespace=ns, model_key=mk)
        own.lookup(keys=keys, node="gpu-0", namespace=ns, model_key=mk)
    _emit(step="warmed up")

    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    hit_blocks = []
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}

    def rest_round(conn: http.client.HTTPConnection, name: str) -> None:
        # The servers close a keep-alive connection after a minute or so idle, less than a round of
        # the other measurements takes at 10M blocks: open a fresh one, outside the timed requests.
        conn.close()
        conn.request("GET", "/livez")
        conn.getresponse().read()
        lat = []
        for _ in range(nrest):
            ns, mk, keys = world.prompt(1)
            body = json.dumps(
                {"namespace": ns, "model_key": str(mk), "node": "gpu-0", "prefix_keys": [str(k) for k in keys]}
            )
            began = time.perf_counter()
            conn.request("POST", "/api/v1/blocks/lookup/", body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            lat.append(time.perf_counter() - began)
            if response.status != 200:
                raise RuntimeError(f"REST lookup answered {response.status}: {payload[:300]!r}")
        record(f"{name}_p50", _percentile(lat, 50) * 1e3)
        record(f"{name}_p99", _percentile(lat, 99) * 1e3)

    with contextlib.ExitStack() as servers:
        http_conn = http.client.HTTPConnection(
            "127.0.0.1", servers.enter_context(_server("wsgi", pooled=True)), timeout=30
        )
        asgi_conn = http.client.HTTPConnection(
            "127.0.0.1", servers.enter_context(_server("asgi", pooled=True)), timeout=30
        )
        unpooled_conn = http.client.HTTPConnection(
            "127.0.0.1", servers.enter_context(_server("asgi", pooled=False)), timeout=30
        )
        for repeat in range(repeats):
            lat = []
            for _ in range(n64):
                ns, mk, keys = world.prompt(1)
                began = time.perf_counter()
                found = blocks_lookup(namespace=ns, model_key=mk, node="gpu-0", prefix_keys=keys)
                lat.append(time.perf_counter() - began)
                hit_blocks.append(found.hits)
            record("lookup64_p50", _percentile(lat, 50) * 1e3)
            record("lookup64_p99", _percentile(lat, 99) * 1e3)
            _emit(step=f"lookup64 round {repeat + 1}")
            for prefix, client in (("node", node), ("node_role", own)):
                lat = []
                for _ in range(n64):
                    ns, mk, keys = world.prompt(1)
                    began = time.perf_counter()
                    client.lookup(keys=keys, node="gpu-0", namespace=ns, model_key=mk)
                    lat.append(time.perf_counter() - began)
                record(f"{prefix}_lookup64_p50", _percentile(lat, 50) * 1e3)
                record(f"{prefix}_lookup64_p99", _percentile(lat, 99) * 1e3)
            lat = []
            for _ in range(n1024):
                ns, mk, keys = world.prompt(16)
                began = time.perf_counter()
                blocks_lookup(namespace=ns, model_key=mk, node="gpu-0", prefix_keys=keys)
                lat.append(time.perf_counter() - began)
            record("lookup1024_p50", _percentile(lat, 50) * 1e3)
            record("lookup1024_p99", _percentile(lat, 99) * 1e3)
            _emit(step=f"lookup1024 round {repeat + 1}")
            rest_round(http_conn, "rest_lookup64")
            rest_round(asgi_conn, "rest_asgi_lookup64")
            rest_round(unpooled_conn, "rest_unpooled_lookup64")
            _emit(step=f"REST lookup round {repeat + 1}")
            # Registration of new blocks, 4096 (with one copy each) per call.
            ns_index = repeat % NAMESPACES
            regs_batches = [
                [
                    _registration(
                        world.namespace_names[ns_index], world.model_keys[0], i, checksum=secrets.token_hex(16)
                    )
                    for i in range(4096)
                ]
                for _ in range(batches)
            ]
            wal_before = _wal_position()
            began = time.perf_counter()
            for regs in regs_batches:
                blocks_register(registrations=regs, source="bench")
            record("register", batches * 4096 / (time.perf_counter() - began))
            record("register_burst_wal", _wal_bytes_since(wal_before) / (batches * 4096))
            record("register_2writers", _two_writers(world, ns_index, batches))
            wal_before = _checkpoint()
            written = _writers(world, ns_index, WRITERS, sustained_batches)
            rate, registered = written.blocks / written.seconds, written.blocks
            record("register_4writers_writers_cpu_us", written.writers_cpu_s / registered * 1e6)
            if written.machine_cpu_s is not None:
                record("register_4writers_cpu_us", written.machine_cpu_s / registered * 1e6)
            wal = _wal_bytes_since(wal_before)
            images = _wal_images(wal_before)
            record("register_4writers", rate)
            record("register_wal", wal / registered)
            if images is not None:
                record("register_wal_images", images / registered)
                record("register_wal_records", (wal - images) / registered)
            for name, client in (("writebehind", node), ("node_role_writebehind", own)):
                regs = [
                    _registration(world.namespace_names[ns_index], world.model_keys[1], i)
                    for i in range(batches * 4096)
                ]
                began = time.perf_counter()
                for start in range(0, len(regs), CHAIN):
                    client.register(blocks=regs[start : start + CHAIN])
                if not client.flush(timeout=600):
                    raise RuntimeError(f"{name}: the write-behind did not drain: {client.stats()}")
                record(name, len(regs) / (time.perf_counter() - began))
            _emit(step=f"registration round {repeat + 1}")
    node.close()
    own.close()
    if not any(hit_blocks):
        raise RuntimeError("no lookup found anything: the seed or the lookup is broken")
    median = {name: statistics.median(values) for name, values in results.items()}
    params = {"blocks": world.blocks, "repeats": repeats}

    def spread(name: str) -> dict[str, Any]:
        """The rounds' least and greatest value: the spread beside the median."""
        return {"min": round(min(results[name]), 4), "max": round(max(results[name]), 4)}

    _row("directory.lookup64_p50_ms", median["lookup64_p50"], "ms", samples=n64, **params)
    _row("directory.lookup64_p99_ms", median["lookup64_p99"], "ms", samples=n64, **params)
    _row("directory.lookup1024_p99_ms", median["lookup1024_p99"], "ms", samples=n1024, **params)
    _row("directory.lookup1024_p50_ms", median["lookup1024_p50"], "ms", samples=n1024, **params)
    _row("directory.node_lookup64_p50_ms", median["node_lookup64_p50"], "ms", samples=n64, **params)
    _row(
        "directory.node_lookup64_p99_ms",
        median["node_lookup64_p99"],
        "ms",
        samples=n64,
        **spread("node_lookup64_p99"),
        **params,
    )
    for pct in ("p50", "p99"):
        _row(
            f"directory.node_role_lookup64_{pct}_ms",
            median[f"node_role_lookup64_{pct}"],
            "ms",
            samples=n64,
            **params,
        )
    for variant, server, pool in (
        ("rest", "gunicorn (WSGI, the engine API)", "psycopg_pool 2..8"),
        ("rest_asgi", "daphne (ASGI)", "psycopg_pool 2..8"),
        ("rest_unpooled", "daphne (ASGI)", "none"),
    ):
        for pct in ("p50", "p99"):
            _row(
                f"directory.{variant}_lookup64_{pct}_ms",
                median[f"{variant}_lookup64_{pct}"],
                "ms",
                samples=nrest,
                server=server,
                db_pool=pool,
                **params,
            )
    _row("directory.register_blocks_per_s", median["register"], "blocks/s", batch=4096, batches=batches, **params)
    _row(
        "directory.register_burst_wal_bytes_per_block",
        median["register_burst_wal"],
        "bytes",
        batch=4096,
        batches=batches,
        note="one caller's 40 calls, wherever the last checkpoint fell: mostly full-page images when it was recent",
        **params,
    )
    sustained: dict[str, Any] = {
        "batch": 4096,
        "writers": WRITERS,
        "blocks_registered": WRITERS * sustained_batches * 4096,
        "cores": os.cpu_count(),
    }
    sustained["writers_cpu_us_per_block"] = round(median["register_4writers_writers_cpu_us"], 1)
    if "register_4writers_cpu_us" in median:
        # The rest is the database server's (and whatever else ran): what a rate costs its cores.
        machine = median["register_4writers_cpu_us"]
        database = machine - median["register_4writers_writers_cpu_us"]
        sustained["machine_cpu_us_per_block"] = round(machine, 1)
        sustained["database_cpu_us_per_block"] = round(database, 1)
        sustained["database_cores_for_100k_per_s"] = round(database * 1e-6 * 100_000, 2)
    _row(
        "directory.register_4writers_blocks_per_s",
        median["register_4writers"],
        "blocks/s",
        note=f"{WRITERS} processes at once, each on its own connection, right after a checkpoint",
        **spread("register_4writers"),
        **sustained,
        **params,
    )
    split = {}
    if "register_wal_images" in median:
        split = {
            "image_bytes_per_block": round(median["register_wal_images"], 1),
            "record_bytes_per_block": round(median["register_wal_records"], 1),
        }
    _row(
        "directory.register_wal_bytes_per_block",
        median["register_wal"],
        "bytes",
        note=f"WAL over the {WRITERS} writers' stretch after a checkpoint, full-page images included",
        **spread("register_wal"),
        **sustained,
        **split,
        **params,
    )
    _row(
        "directory.register_2writers_blocks_per_s",
        median["register_2writers"],
        "blocks/s",
        batch=4096,
        batches=batches,
        writers=2,
        note="two callers at once, each on its own connection: the directory's capacity when nodes register together",
        **params,
    )
    _row("directory.writebehind_blocks_per_s", median["writebehind"], "blocks/s", **params)
    _row("directory.node_role_writebehind_blocks_per_s", median["node_role_writebehind"], "blocks/s", **params)
    _row("directory.lookup64_hit_blocks_mean", statistics.fmean(hit_blocks), "blocks", **params)
    _explain(world)
    _emit(step="explained")


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
