"""Suite `movements`: move throughput between tiers against the slower tier's raw limit, and the
planner's time at 1M blocks (10M with ``--scale 10``).

The suite creates its own database (``strata_bench_movements_<pid>``) on the configured server,
migrates it and measures in a child process whose Django points at it:

* ``move_gbps_<src>_<dst>``: movements of distinct blocks of a Llama-3-8B-shaped layout (32 MiB)
  executed by the node's MovementExecutor (ledger rows, pending target, verified read, put,
  verification of the target, epoch-fenced flip, free of the source, ledger done) over 256 MiB
  (times --scale) per route: host -> disk, disk -> remote, remote -> host (a warm-up). ``verify
  full`` (the default) reads the target back; ``.header_verify`` rows compare the stored checksum.
* ``raw_gbps_<src>_<dst>``: what the media can do for the same operation, in the same run: the
  slower of the source's raw read and the destination's raw write of the same bytes, and with
  ``verify full`` plus the destination's raw read (that verification reads every byte of the
  copy back from the destination medium, which the write shares: a disk's reads and writes
  together move about what its writes alone do). Raw I/O: torch copy_ out of / into a /dev/shm
  mapping (host), sequential O_DIRECT preadv / pwritev + fdatasync of one file (disk), SET
  through redis-py (it sends the buffer as it is) and GET received straight into a buffer with
  recv_into (remote: redis-py's parser copies a big reply twice and would make the medium look
  several times slower than it is).
  ``_vs_raw`` rows divide the two (the median of per-repetition ratios, ours and raw run back
  to back, alternating which goes first). Target: >= 0.8. The remote tier is a private
  redis-server without persistence, as an L3 cache store runs (the broker's append-only Redis
  rewrites its log in a fork of the whole dataset at moments of its own choosing, which would
  make passes of the same size differ widely).
* ``plan_ms``: ``movements_plan(dry_run=True)`` for one node whose host tier is over its high watermark, in
  a directory of 1M blocks over 8 nodes (a third each on host, disk and remote).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = "move GB/s per route vs. the slower tier's raw limit; planner ms at 1M blocks"
FULL_MOVE_BYTES = 256 << 20
FULL_BLOCKS = 1_000_000
NODES = 8
MOVE_REPEATS = 9
"""Repetitions of each route at least: the media of a shared machine drift within a minute, and
the median of 9 paired repetitions varies far less from run to run than that of 5 (figures in
benchmarks/README.md)."""
ROUTES = (("host", "disk"), ("disk", "remote"), ("remote", "host"))
EXPECTED_ROWS = (*(f"movements.move_gbps_{src}_{dst}_vs_raw" for src, dst in ROUTES), "movements.plan_ms")
"""Each route's moves against the slower medium, and the planner's time."""


def run(ctx: Any) -> list[Any]:
    from benchmarks.harness import run_child
    from benchmarks.runtime.database import scratch_database
    from benchmarks.suites.tiers import private_redis

    spec = {
        "scale": ctx.scale,
        "repeats": ctx.repeats,
        "scratch": str(ctx.scratch),
        "blocks": max(20_000, int(FULL_BLOCKS * ctx.scale)),
        "move_bytes": max(64 << 20, int(FULL_MOVE_BYTES * ctx.scale)),
        "move_repeats": max(MOVE_REPEATS, ctx.repeats),
    }
    name = f"strata_bench_movements_{os.getpid()}"
    ctx.params.update(database=name, blocks=spec["blocks"], move_bytes=spec["move_bytes"])
    with scratch_database(name) as url, private_redis(ctx.scratch) as redis_url:
        spec["redis_url"] = redis_url
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
            "STRATA_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
        rows = run_child(ctx, "benchmarks.suites.movements", spec, env)
    return rows


# -- the child process ------------------------------------------------------------------------------


def _emit(**message: Any) -> None:
    print(json.dumps(message), flush=True)


class _Raw:
    """Raw read and write of one medium, the same bytes and buffers as the moves use."""

    def __init__(self, layout: Any, blocks: int, scratch: Path, redis_url: str) -> None:
        import redis
        import torch

        self.layout, self.blocks = layout, blocks
        self.total = blocks * layout.block_bytes
        self.buffers = [layout.empty() for _ in range(2)]
        for b in self.buffers:
            b.copy_(torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8))
        self.shm = Path("/dev/shm") / f"strata-bench-raw-{os.getpid()}"
        fd = os.open(self.shm, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, self.total)
        self.mapping = mmap.mmap(fd, self.total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        self.region = torch.frombuffer(self.mapping, dtype=torch.uint8).view(blocks, layout.block_bytes)
        self.file = scratch / "raw-o_direct.bin"
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=60)

    def host_write(self) -> None:
        for i in range(self.blocks):
            self.region[i].copy_(self.buffers[i % 2])

    def host_read(self) -> None:
        for i in range(self.blocks):
            self.buffers[i % 2].copy_(self.region[i])

    def disk_write(self) -> None:
        from worker.dataplane.buffers import host_view

        self.file.unlink(missing_ok=True)
        fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for i in range(self.blocks):
                os.pwritev(fd, [host_view(self.buffers[i % 2])], i * self.layout.block_bytes)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def disk_read(self) -> None:
        from worker.dataplane.buffers import host_view

        fd = os.open(self.file, os.O_RDONLY | os.O_DIRECT)
        try:
            for i in range(self.blocks):
                os.preadv(fd, [host_view(self.buffers[i % 2])], i * self.layout.block_bytes)
        finally:
            os.close(fd)

    def remote_clear(self) -> None:
        """Untimed, before each raw remote write: the moves write blocks Redis has not held
        before, so the raw pass writes new keys too (an overwrite reuses the old values' memory,
        which a fresh value has to be given, page by page, by a virtual machine's hypervisor)."""
        self.redis.delete(*[f"strata-bench-raw:{i}" for i in range(self.blocks)])

    def remote_write(self) -> None:
        for i in range(self.blocks):
            self.redis.set(f"strata-bench-raw:{i}", self.buffers[i % 2].numpy().data)

    def remote_read(self) -> None:
        """GET every value, its reply received straight into a block buffer (no parsing copies)."""
        from worker.dataplane.buffers import host_view

        head = bytearray(64)
        connection = self.redis.connection_pool.get_connection()
        try:
            sock = connection._sock
            for i in range(self.blocks):
                connection.send_command("GET", f"strata-bench-raw:{i}")
                got = 0
                while (end := head.find(b"\r\n", 0, got)) < 0:
                    got += sock.recv_into(memoryview(head)[got:])
                length = int(head[1:end])
                data = host_view(self.buffers[i % 2])
                assert head[:1] == b"$" and length == len(data), "the raw value is not one block"
                filled = got - end - 2
                data[:filled] = head[end + 2 : got]
                while filled < length:
                    filled += sock.recv_into(data[filled:])
                tail = 0
                while tail < 2:
                    tail += len(sock.recv(2 - tail))
        finally:
            self.redis.connection_pool.release(connection)

    def close(self) -> None:
        for key in self.redis.scan_iter(match="strata-bench-raw:*"):
            self.redis.delete(key)
        self.file.unlink(missing_ok=True)
        self.region = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.mapping.close()
        self.shm.unlink(missing_ok=True)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _moves(spec: dict[str, Any]) -> None:
    from controlplane.directory.models import Block, Placement
    from controlplane.directory.services import (
        TierReport,
        blocks_register,
        modelprofile_create,
        namespace_ensure,
        node_heartbeat,
    )
    from controlplane.movements.choices import MovementKind
    from controlplane.movements.planner import PlannedMovement
    from controlplane.movements.services import movements_record
    from worker.dataplane.directory import BlockRegistration
    from worker.dataplane.layout import BlockLayout
    from worker.dataplane.store import TieredStore
    from worker.dataplane.tiers.disk import DiskTier
    from worker.dataplane.tiers.host import HostTier
    from worker.dataplane.tiers.remote import RemoteTier, redis_client
    from worker.movement_executor import MovementExecutor, MovementOptions

    layout = BlockLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=256, dtype="bfloat16")
    blocks = max(2, spec["move_bytes"] // layout.block_bytes)
    scratch = Path(spec["scratch"])
    redis_url = spec["redis_url"]
    pool = f"strata-bench-mv-{os.getpid()}"
    prefix = f"strata-bench-mv-{uuid.uuid4().hex[:6]}"
    capacity = 2 * blocks * (layout.block_bytes + (1 << 20))
    store = TieredStore(
        layout=layout,
        tiers=[
            HostTier(layout=layout, capacity_bytes=capacity, pool_name=pool),
            DiskTier(layout=layout, capacity_bytes=capacity, path=scratch / "disk"),
            RemoteTier(
                layout=layout, capacity_bytes=capacity, client=redis_client(redis_url, timeout_s=60), prefix=prefix
            ),
        ],
    )
    raw = _Raw(layout, blocks, scratch, redis_url)
    profile = modelprofile_create(
        name="bench-llama3-8b",
        model_id="bench/llama3-8b",
        layers=32,
        kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_tokens=256,
    )
    namespace_ensure(name="default")
    node_heartbeat(
        name="gpu-0",
        host="bench",
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier=t, capacity_bytes=capacity, used_bytes=0) for t in ("host", "disk", "remote")],
    )
    _emit(param={"move_block_bytes": layout.block_bytes, "move_blocks": blocks})
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for verify in ("full", "header"):
            executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(verify=verify))
            for rep in range(spec["move_repeats"]):
                keys = [uuid.uuid4() for _ in range(blocks)]
                registrations = []
                for i, key in enumerate(keys):
                    put = store.put(key, raw.buffers[i % 2], tier="host")
                    registrations.append(
                        BlockRegistration(
                            namespace="default",
                            model_key=profile.model_key,
                            prefix_key=key,
                            content_key=uuid.uuid4(),
                            position=0,
                            tokens=256,
                            tier="host",
                            node="gpu-0",
                            nbytes=layout.block_bytes,
                            checksum=put.checksum.hex,
                        )
                    )
                blocks_register(registrations=registrations)
                ids = list(Block.objects.filter(prefix_key__in=keys).values_list("id", flat=True))
                for src, dst in ROUTES:
                    kind = MovementKind.WARM if src == "remote" else MovementKind.MOVE
                    planned = []
                    for p in Placement.objects.filter(block_id__in=ids, tier=src, state="ready"):
                        planned.append(
                            PlannedMovement(
                                block_id=p.block_id,
                                kind=kind,
                                reason="manual",
                                src_placement_id=p.id,
                                src_epoch=p.epoch,
                                src_tier=src,
                                src_node="" if src == "remote" else "gpu-0",
                                dst_tier=dst,
                                dst_node="" if dst == "remote" else "gpu-0",
                                exec_node="gpu-0",
                                bytes=layout.block_bytes,
                            )
                        )
                    written = movements_record(
                        plan_id=uuid.uuid4(),
                        movements=planned,
                        policy_version=0,
                        mode="",
                        now=Placement.objects.first().updated_at,
                    )

                    def raw_pass(src: str = src, dst: str = dst, verify: str = verify) -> float:
                        # Raw passes in route order: each reads what the previous route's raw pass wrote.
                        raw_read = _timed(getattr(raw, f"{src}_read"))
                        if dst == "remote":
                            raw.remote_clear()
                        raw_write = _timed(getattr(raw, f"{dst}_write"))
                        slower = max(raw_read, raw_write)
                        if verify == "full":  # the copy is read back from the destination medium
                            slower += _timed(getattr(raw, f"{dst}_read"))
                        return slower

                    def ours_pass(ex: Any = executor, ids: Any = written, k: str = kind) -> float:
                        seconds = _timed(lambda: ex.run(k, ids))
                        # The disk tier unlinks freed sources in the background: done before the
                        # next pass, untimed, so they never slow the raw pass that follows.
                        store.tier("disk").drain_deletes()
                        return seconds

                    if rep % 2:  # alternate which goes first, so drift hits both alike
                        slower = raw_pass()
                        ours = ours_pass()
                    else:
                        ours = ours_pass()
                        slower = raw_pass()
                    label = f"{src}_{dst}" + ("" if verify == "full" else ".header_verify")
                    entry = results.setdefault(label, {"ours": [], "raw": []})
                    entry["ours"].append(ours)
                    entry["raw"].append(slower)
                    _emit(step=f"move {label} {rep + 1}/{spec['move_repeats']}")
                # The warm left a remote copy: clear the remote tier for the next repetition.
                for p in Placement.objects.filter(block_id__in=ids):
                    store.delete(Block.objects.get(id=p.block_id).prefix_key)
                Placement.objects.filter(block_id__in=ids).delete()
    finally:
        raw.close()
        client = store.tier("remote").client
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        store.tier("host").unlink()
        store.close()
    nbytes = blocks * layout.block_bytes
    for label, entry in results.items():
        ours_gbps = statistics.median(nbytes / t / 1e9 for t in entry["ours"])
        raw_gbps = statistics.median(nbytes / t / 1e9 for t in entry["raw"])
        ratio = statistics.median(r / o for o, r in zip(entry["ours"], entry["raw"], strict=True))
        base = label.split(".")[0]
        suffix = label[len(base) :]
        _emit(row={"name": f"movements.move_gbps_{base}{suffix}", "value": ours_gbps, "unit": "GB/s"})
        _emit(
            row={
                "name": f"movements.raw_gbps_{base}{suffix}",
                "value": raw_gbps,
                "unit": "GB/s",
                "note": "slower of the source's raw read and the destination's raw write"
                + ("" if suffix else ", plus the destination's raw read (the copy is read back)"),
            }
        )
        _emit(
            row={
                "name": f"movements.move_gbps_{base}{suffix}_vs_raw",
                "value": ratio,
                "unit": "x",
                "baseline": f"movements.raw_gbps_{base}{suffix}",
                "note": "target >= 0.8",
            }
        )


def _plan_ms(spec: dict[str, Any]) -> None:
    from django.db import connection
    from django.utils import timezone

    from controlplane.directory.models import ModelProfile, Namespace, Node
    from controlplane.directory.services import TierReport, node_heartbeat
    from controlplane.movements.planner import candidates_params, candidates_sql
    from controlplane.movements.services import movements_plan
    from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec

    total = spec["blocks"]
    profile = ModelProfile.objects.first()
    namespace = Namespace.objects.get(name="default")
    nodes = []
    for i in range(NODES):
        nodes.append(
            node_heartbeat(
                name=f"plan-{i}",
                host="bench",
                heartbeat_seconds=5.0,
                tiers=[
                    TierReport(tier="host", capacity_bytes=1 << 40, used_bytes=1 << 40),
                    TierReport(tier="disk", capacity_bytes=1 << 44, used_bytes=0),
                    TierReport(tier="remote", capacity_bytes=1 << 46, used_bytes=0),
                ],
            ).id
        )
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO directory_block (namespace_id, model_id, prefix_key, content_key, position, token_count, "
            "size_bytes, priority, created_at, last_access_at, access_count) "
            "SELECT %s, %s, gen_random_uuid(), gen_random_uuid(), (g %% 64) * 256, 256, 33554432, 'default', now(), "
            "now() - make_interval(secs => (g::bigint * 7919) %% 86400), g %% 13 FROM generate_series(1, %s) g",
            [namespace.id, profile.id, total],
        )
        cursor.execute(
            'INSERT INTO directory_placement (block_id, tier, node_id, locator, "offset", size_bytes, checksum, '
            "state, epoch, updated_at) SELECT b.id, (ARRAY['host','disk','remote'])[b.id %% 3 + 1], "
            "CASE WHEN b.id %% 3 = 2 THEN NULL ELSE (%s::bigint[])[(b.id / 3) %% %s + 1] END, '', 0, 33554432, '', "
            "'ready', 1, now() FROM directory_block b WHERE b.size_bytes = 33554432",
            ["{" + ",".join(map(str, nodes)) + "}", NODES],
        )
        cursor.execute("VACUUM ANALYZE directory_block")
        cursor.execute("VACUUM ANALYZE directory_placement")
    _emit(log=f"seeded {total} blocks over {NODES} nodes in {time.perf_counter() - started:.1f} s")
    host_copies = total // 3 // NODES
    snapshot = PolicySnapshot(
        version=1, mode="", classes=(), tiers=(TierPolicySpec(tier="host", high_watermark=0.9, low_watermark=0.85),)
    )
    times = []
    for rep in range(max(3, spec["repeats"])):
        started = time.perf_counter()
        result = movements_plan(snapshot=snapshot, node="plan-3", reason="schedule", dry_run=True)
        times.append((time.perf_counter() - started) * 1000)
        _emit(step=f"plan {rep + 1}")
    spec_host = snapshot.tier("host")
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS) " + candidates_sql(algorithm="lru", remote=False),
            candidates_params(
                snapshot=snapshot,
                spec=spec_host,
                node_id=Node.objects.get(name="plan-3").id,
                tier="host",
                needed=(1 << 40) // 20,
                now=timezone.now(),
                namespaces={namespace.id: "default"},
            ),
        )
        text = "\n".join(r[0] for r in cursor.fetchall())
    _emit(log=f"EXPLAIN (ANALYZE, BUFFERS) of the host victim query at {total} blocks:\n{text}")
    _emit(param={"explain_plan": text, "plan_host_copies_on_node": host_copies, "plan_victims": len(result.movements)})
    if "Seq Scan on directory_block" in text or "Seq Scan on directory_placement" in text:
        _emit(log="WARNING: the victim query has a sequential scan")
    _emit(
        row={
            "name": "movements.plan_ms",
            "value": statistics.median(times),
            "unit": "ms",
            "params": {"blocks": total, "host_copies_on_node": host_copies, "victims": len(result.movements)},
        }
    )


def child(spec: dict[str, Any]) -> None:
    import django

    django.setup()
    from django.core.management import call_command

    _emit(plan=2 + 3 * 2 * spec["move_repeats"] + max(3, spec["repeats"]))
    call_command("migrate", verbosity=0, interactive=False)
    _emit(step="migrated")
    _moves(spec)
    _plan_ms(spec)
    _emit(step="done")


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
