"""The remote tier on Redis/Valkey: blocks as strings (standalone or cluster), one layer readable by GETRANGE.

A value is ``[header][block bytes]``; the header (a multiple of 64 bytes) holds the key, the
layout, the block and per-layer checksums and a hash of itself, so the checksum travels with
the value. Keys are ``<prefix>:blk:<key hex>`` (one prefix per deployment); capacity accounting
lives in the hash ``<prefix>:usage``, shared by every node: stored bytes and blocks, and the
reservations of puts in flight, each with a lease so a killed writer's lapses
(`accounting.UsageHash`). `recount` corrects the hash to what the store holds.

* Writes send the header and the tensor's memory as one SET without joining them first (no
  extra copy of the block); a cluster that redirects falls back to an ordinary SET.
* Batched layer reads are one pipeline: per block, a GETRANGE of the header and one of the
  layers; every byte returned is hashed while it is copied into the destination.
* A whole-block read into host memory (a movement's source read or verification) is one GET
  whose reply the socket writes straight into the header buffer and the destination
  (``recv_into``); the layers are then hashed in place and verified.
* Redis down (connection refused, timeout, loading, cluster down) raises TierUnavailable and is
  counted; redis-py reconnects on the next call, so the tier recovers when Redis returns. A
  server that let a command time out (a silent server, a path that drops packets) is not waited
  on again for `retry_after_s`: meanwhile every call raises TierUnavailable at once (counted the
  same), so each load of the requests behind it fails fast and recomputes instead of paying
  the socket timeout again.

The `remote` level can also be a shared filesystem mount (CephFS, NFS, Lustre, 3FS), served by
the disk tier: `worker.dataplane.tiers.mediums.remote_medium` picks the medium from the URL.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import cast

import redis
import redis.exceptions
import torch

from worker.dataplane.buffers import aligned_empty, buffer_address, host_view, round_up
from worker.dataplane.checksum import BlockChecksum, Hasher, Span, layer_prefix
from worker.dataplane.counters import Counters
from worker.dataplane.errors import BlockMissing, TierFull, TierUnavailable
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.base import PutResult, ReadResult, Recount, Tier, TierUsage
from worker.dataplane.tiers.header import HeaderInvalid, header_length, pack_header, parse_header
from worker.dataplane.tiers.remote.accounting import UsageHash
from worker.dataplane.tiers.remote.client import ACCOUNTING_ERRORS, UNAVAILABLE_ERRORS, RedisClient
from worker.dataplane.tiers.remote.wire import receive_value, set_without_join

MAGIC = b"STRATARM"
READ_CHUNK_BYTES = 2 * 1024 * 1024
PIPELINE_BYTES = 2 * 1024 * 1024
"""Reads go as GETRANGEs of whole layers of at most READ_CHUNK_BYTES, pipelined at most
PIPELINE_BYTES of replies at a time. redis-py's pure-Python parser slows down on big replies
(its read buffer grows and is copied): 2 MiB GETRANGEs of a block beat one GET of it, and
pipelining many megabytes of replies at once is slower than not pipelining
(benchmarks/README.md). Small replies (headers, small layers) still share round trips, which is
what pipelining is for over a real network."""


LEASE_S = 60.0
"""How long a put's reservation (or a delete's intent) counts when its writer never settles it:
longer than any put takes (a block's SET under the client's timeouts), short enough that a
killed writer's bytes come back soon."""


class RemoteTier(Tier):
    """Blocks in a Redis/Valkey deployment under `prefix`, `capacity_bytes` of them in all."""

    lookups_are_cheap = False

    def __init__(
        self,
        *,
        layout: BlockLayout,
        capacity_bytes: int,
        client: RedisClient,
        prefix: str,
        counters: Counters | None = None,
        hasher: Hasher | None = None,
        io_threads: int = 2,
        name: str = "remote",
        lease_s: float = LEASE_S,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(name=name, layout=layout, counters=counters, hasher=hasher, io_threads=io_threads)
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"remote key prefix must be non-empty without spaces, got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self.capacity_bytes = capacity_bytes
        self.header_bytes = round_up(header_length(layout), 64)
        self.value_bytes = self.header_bytes + layout.block_bytes
        self._usage = UsageHash(client, prefix=prefix, lease_s=lease_s)
        self._local = threading.local()
        self.retry_after_s = retry_after_s
        """After a command timed out, seconds the server is not asked again."""
        self._silent_until = 0.0

    def key_name(self, key: uuid.UUID) -> bytes:
        return f"{self.prefix}:blk:{key.hex}".encode()

    # -- errors ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _medium(self) -> Iterator[None]:
        """Turns "Redis is not there" into TierUnavailable (counted), at once while a timeout is
        recent (`retry_after_s`)."""
        if time.monotonic() < self._silent_until:
            self.counters.add(f"{self.name}.unavailable")
            raise TierUnavailable(self.name, reason=f"a command timed out less than {self.retry_after_s:g} s ago")
        try:
            yield
        except UNAVAILABLE_ERRORS as exc:
            if isinstance(exc, redis.exceptions.TimeoutError):
                self._silent_until = time.monotonic() + self.retry_after_s
            self.counters.add(f"{self.name}.unavailable")
            raise TierUnavailable(self.name, reason=f"{type(exc).__name__}: {exc}") from exc

    def ping(self) -> None:
        """Raise TierUnavailable unless the server answers."""
        with self._medium():
            self.client.ping()

    # -- header ---------------------------------------------------------------------------
    def _pack_header(self, key: uuid.UUID, checksum: BlockChecksum) -> bytes:
        header = pack_header(magic=MAGIC, layout=self.layout, key=key, checksum=checksum)
        return header + bytes(self.header_bytes - len(header))

    def _parse_header(self, key: uuid.UUID, raw: bytes) -> BlockChecksum:
        if len(raw) < header_length(self.layout):
            raise self._corrupt(key, f"value header is truncated ({len(raw)} bytes)")
        try:
            return parse_header(magic=MAGIC, layout=self.layout, key=key, raw=raw, holder="value")
        except HeaderInvalid as exc:
            raise self._corrupt(key, str(exc)) from None

    # -- writes ---------------------------------------------------------------------------
    def put(self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None) -> PutResult:
        src = self._block_bytes(data)
        layout = self.layout
        if src.device.type != "cpu":
            src = src.cpu()  # redis-py sends from host memory
        if checksum is None:
            computed = self.hasher.checksum(key, src, layout)
            assert isinstance(computed, BlockChecksum)
            checksum = computed
        else:
            self._check_layers(checksum)
        header = self._pack_header(key, checksum)
        name = self.key_name(key)
        size = self.value_bytes
        try:
            with self._medium():
                old_len = int(self.client.strlen(name) or 0)  # an overwrite frees the old value's bytes
                field, used = self._usage.reserve(key, size=size, before=old_len, capacity=self.capacity_bytes)
        except redis.exceptions.OutOfMemoryError as exc:  # Redis is past maxmemory already
            self.counters.add(f"{self.name}.full")
            raise TierFull(self.name, needed=size, detail=str(exc)) from exc
        if field is None:
            self.counters.add(f"{self.name}.full")
            raise TierFull(self.name, needed=size, free=max(0, self.capacity_bytes - used))
        try:
            with self._medium():
                set_without_join(self.client, name, header, host_view(src))
        except redis.exceptions.OutOfMemoryError as exc:
            self._settle(field)
            self.counters.add(f"{self.name}.full")
            raise TierFull(self.name, needed=size, detail=str(exc)) from exc
        except BaseException:
            self._settle(field)
            raise
        # The block is stored either way; a lost settle is the next recount's to correct.
        self._settle(field, nbytes=size - old_len, blocks=0 if old_len else 1)
        self.counters.add(f"{self.name}.puts")
        self.counters.add(f"{self.name}.bytes_written", layout.block_bytes)
        return PutResult(key=key, tier=self.name, nbytes=layout.block_bytes, checksum=checksum)

    def put_many(
        self,
        items: Sequence[tuple[uuid.UUID, torch.Tensor]],
        *,
        checksums: Sequence[BlockChecksum | None] | None = None,
    ) -> list[Future[PutResult]]:
        """The blocks one after another on one I/O thread: redis-py spends its time in Python,
        so parallel SETs only fight over the GIL, and the server is one thread."""
        checksums = list(checksums) if checksums is not None else [None] * len(items)
        if len(checksums) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(checksums)} checksums")
        futures: list[Future[PutResult]] = [Future() for _ in items]

        def run() -> None:
            for future, (key, data), checksum in zip(futures, items, checksums, strict=True):
                try:
                    future.set_result(self.put(key, data, checksum=checksum))
                except BaseException as exc:
                    future.set_exception(exc)

        if items:
            self._submit(run)
        return futures

    def _settle(self, field: bytes, *, nbytes: int = 0, blocks: int = 0) -> None:
        """End an operation's intent (releasing its reservation) and account what it changed."""
        with contextlib.suppress(*ACCOUNTING_ERRORS):
            self._usage.settle(field, nbytes=nbytes, blocks=blocks)

    # -- reads ----------------------------------------------------------------------------
    def _host_out(self, dst: torch.Tensor) -> torch.Tensor:
        if dst.device.type == "cpu":
            return dst
        staging = getattr(self._local, "staging", None)
        if staging is None or staging.numel() < dst.numel():
            staging = self._local.staging = aligned_empty(dst.numel(), pin=True)
        return staging[: dst.numel()]

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        dst = self._block_bytes(out)
        if dst.device.type == "cpu" and isinstance(self.client, redis.Redis):
            return self._get_direct(key, dst)
        result = self._read_batch([key], range(self.layout.layers), [dst])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _get_direct(self, key: uuid.UUID, dst: torch.Tensor) -> ReadResult:
        """A whole block into host memory with one GET, received straight into place: redis-py's
        parser would gather the reply in its buffer and copy it into a bytes object, at a
        fraction of the speed of receiving it into place (benchmarks/README.md). The bytes are
        hashed in place and verified before returning."""
        layout = self.layout
        header = getattr(self._local, "header", None)
        if header is None:
            header = self._local.header = bytearray(self.header_bytes)
        with self._medium():
            # `get` receives directly with a single-server client only.
            length = receive_value(
                cast(redis.Redis, self.client), self.key_name(key), memoryview(header), host_view(dst)
            )
        if length is None:
            self.counters.add(f"{self.name}.misses")
            raise BlockMissing(key, tier=self.name)
        if length != self.value_bytes:
            raise self._corrupt(key, f"value is {length} bytes, a block's is {self.value_bytes}")
        checksum = self._parse_header(key, bytes(header))
        lb, base = layout.layer_bytes, dst.data_ptr()
        layers = range(layout.layers)
        spans = [Span(src=base + j * lb, nbytes=lb, prefix=layer_prefix(key, j)) for j in layers]
        self._verify(key, layers, self.hasher.run(spans), checksum.layers)
        self.counters.add(f"{self.name}.hits")
        self.counters.add(f"{self.name}.bytes_read", layout.block_bytes)
        return ReadResult(
            key=key, tier=self.name, layers=layers, nbytes=layout.block_bytes, checksum=checksum, stored=checksum
        )

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        return self._read_async(self._read_batch, keys, layers, outs)

    def _read_batch(
        self, keys: list[uuid.UUID], layers: range, dsts: list[torch.Tensor]
    ) -> list[ReadResult | BaseException]:
        """Read `layers` of every block: per block a GETRANGE of the header, then GETRANGEs of
        whole layers of at most READ_CHUNK_BYTES each, sent in pipelines of at most
        PIPELINE_BYTES of replies. Every chunk is hashed while it is copied into place."""
        layout = self.layout
        lb = layout.layer_bytes
        per_chunk = max(1, READ_CHUNK_BYTES // lb)
        # (block index, first layer, layer count); a count of 0 is the block's header.
        # (block index, first layer, layer count, with header). The header rides in front of the
        # first chunk when the read starts at layer 0 (it sits right before it in the value),
        # else it is a small request of its own; a chunk that is the whole value is a plain GET.
        requests: list[tuple[int, int, int, bool]] = []
        for i in range(len(keys)):
            if layers.start != 0:
                requests.append((i, 0, 0, True))
            for first in range(layers.start, layers.stop, per_chunk):
                requests.append((i, first, min(per_chunk, layers.stop - first), first == 0))
        results: list[ReadResult | BaseException | None] = [None] * len(keys)
        checksums: dict[int, BlockChecksum] = {}
        host_dsts = [self._host_out(dst) for dst in dsts]
        start = 0
        while start < len(requests):
            stop, payload = start, 0
            while stop < len(requests) and (stop == start or payload + requests[stop][2] * lb <= PIPELINE_BYTES):
                payload += requests[stop][2] * lb
                stop += 1
            batch = requests[start:stop]
            start = stop
            try:
                with self._medium():
                    pipe = self.client.pipeline(transaction=False)
                    for i, first, count, with_header in batch:
                        name = self.key_name(keys[i])
                        if with_header and count == layout.layers:
                            pipe.get(name)  # no server-side substring copy
                        elif with_header:
                            pipe.getrange(name, 0, self.header_bytes + count * lb - 1)
                        else:
                            offset = self.header_bytes + first * lb
                            pipe.getrange(name, offset, offset + count * lb - 1)
                    replies = pipe.execute()
            except BaseException as exc:
                for i, *_ in batch:
                    if results[i] is None:
                        results[i] = exc
                continue
            for (i, first, count, with_header), reply in zip(batch, replies, strict=True):
                if results[i] is not None:
                    continue  # this block already failed
                try:
                    data: bytes | memoryview = reply
                    if with_header:
                        if not reply:
                            self.counters.add(f"{self.name}.misses")
                            raise BlockMissing(keys[i], tier=self.name)
                        checksums[i] = self._parse_header(keys[i], reply[: self.header_bytes])
                        data = memoryview(reply)[self.header_bytes :]
                    if count:
                        self._deliver(
                            keys[i],
                            checksums[i],
                            data,
                            range(first, first + count),
                            host_dsts[i],
                            (first - layers.start) * lb,
                        )
                except BaseException as exc:
                    results[i] = exc
        nbytes = len(layers) * lb
        whole = len(layers) == layout.layers
        for i, dst in enumerate(dsts):
            if results[i] is not None:
                continue
            if host_dsts[i] is not dst:
                dst.copy_(host_dsts[i])
            self.counters.add(f"{self.name}.hits")
            self.counters.add(f"{self.name}.bytes_read", nbytes)
            results[i] = ReadResult(
                key=keys[i],
                tier=self.name,
                layers=layers,
                nbytes=nbytes,
                checksum=checksums[i] if whole else None,
                stored=checksums[i],
            )
        return cast(list[ReadResult | BaseException], results)

    def _deliver(
        self,
        key: uuid.UUID,
        checksum: BlockChecksum,
        payload: bytes | memoryview,
        layers: range,
        out: torch.Tensor,
        out_offset: int,
    ) -> None:
        """Copy and hash one chunk of layers from a reply into `out`, and verify it."""
        lb = self.layout.layer_bytes
        if len(payload) != len(layers) * lb:
            raise self._corrupt(
                key,
                f"value holds {len(payload)} bytes of layers {layers.start}..{layers.stop - 1}, "
                f"{len(layers) * lb} expected",
            )
        src, dst = buffer_address(payload), out.data_ptr() + out_offset
        spans = [
            Span(src=src + j * lb, nbytes=lb, prefix=layer_prefix(key, layer), dst=dst + j * lb)
            for j, layer in enumerate(layers)
        ]
        self._verify(key, layers, self.hasher.run(spans), checksum.layers[layers.start : layers.stop])

    def checksum(self, key: uuid.UUID) -> BlockChecksum:
        """The stored checksum of a block (reads only the header)."""
        with self._medium():
            # bytes: block values are binary, so the tier's client never decodes responses.
            header = cast(bytes, self.client.getrange(self.key_name(key), 0, self.header_bytes - 1))
        if not header:
            raise BlockMissing(key, tier=self.name)
        return self._parse_header(key, header)

    def keys(self) -> list[uuid.UUID]:
        """Keys of every stored block, walking the key space with SCAN (never blocking the
        server the way KEYS would)."""
        prefix = self.key_name(uuid.UUID(int=0))[:-32]
        with self._medium():
            names = list(self.client.scan_iter(match=prefix + b"*", count=1000))
        found = []
        for name in names:
            with contextlib.suppress(ValueError):
                found.append(uuid.UUID(hex=name[len(prefix) :].decode()))
        return found

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The value's data bytes (after the header), fetched with GETRANGE."""
        with self._medium():
            value = cast(bytes, self.client.getrange(self.key_name(key), self.header_bytes, -1))
        return bytes(value) if value else None

    # -- the rest -------------------------------------------------------------------------
    def contains(self, key: uuid.UUID) -> bool:
        with self._medium():
            return bool(self.client.exists(self.key_name(key)))

    def contains_many(self, keys: Sequence[uuid.UUID]) -> list[bool]:
        if not keys:
            return []
        with self._medium():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.key_name(key))
            return [bool(n) for n in pipe.execute()]

    def delete(self, key: uuid.UUID) -> bool:
        name = self.key_name(key)
        with self._medium():
            length = int(self.client.strlen(name) or 0)
            if not length:
                return False
            field: bytes | None = None
            with contextlib.suppress(redis.exceptions.OutOfMemoryError):
                # Past maxmemory Redis refuses the intent but not the DEL, which is what frees
                # memory: the delete goes ahead, and the next recount accounts for it.
                field = self._usage.declare(key, before=length)
            try:
                removed = bool(self.client.delete(name))
            except BaseException:
                if field is not None:
                    self._settle(field)
                raise
        if field is not None:
            self._settle(field, nbytes=-length if removed else 0, blocks=-1 if removed else 0)
        return removed

    def usage(self) -> TierUsage:
        """Stored bytes and blocks as accounted, and the bytes reserved by puts in flight on
        every node (a killed writer's until its lease runs out and a put or a recount prunes it)."""
        with self._medium():
            counted = self._usage.counted()
        return TierUsage(
            tier=self.name,
            capacity_bytes=self.capacity_bytes,
            stored_bytes=counted.bytes,
            pending_bytes=counted.reserved,
            blocks=counted.blocks,
        )

    def recount(self, *, batch: int = 1000) -> Recount | None:
        """Correct the usage hash to what the store holds, walking it with SCAN in batches of
        `batch` keys; safe beside puts and deletes in flight on any node
        (`accounting.UsageHash.recount` says why). None while another recount runs."""
        with self._medium():
            recounted = self._usage.recount(batch=batch)
        if recounted is None:
            return None
        counted = recounted.counted
        return Recount(
            tier=self.name,
            drift_bytes=recounted.drift_bytes,
            drift_blocks=recounted.drift_blocks,
            usage=TierUsage(
                tier=self.name,
                capacity_bytes=self.capacity_bytes,
                stored_bytes=counted.bytes,
                pending_bytes=counted.reserved,
                blocks=counted.blocks,
            ),
        )

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.client.close()
