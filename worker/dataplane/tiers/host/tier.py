"""The host tier: a DRAM pool in POSIX shared memory that every process on the node opens at once.

The pool is one file under /dev/shm (the engine and the node's Celery worker map the same pages):

    [header 4 KiB][slot metadata x n][free-slot stack x n][key index x 2n+][4 KiB-aligned data slots x n]

* Allocation and publication happen under an exclusive ``flock`` on the pool file (plus a
  thread lock: flock does not exclude threads sharing one descriptor). The lock covers only
  metadata updates; bytes are copied outside it.
* The key index is an open-addressing table of slot numbers, hashed by key, that holds every
  slot with a key (being written or readable): finding a key's slots costs a few probes at any
  pool size, where a scan of every slot would grow with the pool on each put, miss and delete.
  It changes under the lock; readers probe it without one. A removed entry becomes a
  tombstone, never an empty bucket, so a probe chain a reader follows never breaks; the table
  is rebuilt (tombstones dropped) under the lock when they pile up, with a seqlock counter of
  its own that sends a reader who raced a rebuild to a full scan.
* Reads take no lock. Each slot carries a seqlock generation: odd while the slot changes, even
  when stable. A reader notes the generation, copies and hashes, then checks the generation
  again; if it moved (an overwrite or eviction raced the read) the copy is discarded and
  retried, so torn bytes are never returned. The checksum is verified on top of that.
* Under CUDA the data region is pinned with cudaHostRegister, so host-to-device copies from
  the pool run asynchronously at full PCIe speed.

This relies on x86-64 store ordering (TSO) between processes, as every Linux node we target
has; the generation is written last when publishing and first when invalidating.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import numpy as np
import torch

from worker.dataplane import native
from worker.dataplane.buffers import cuda_available
from worker.dataplane.checksum import (
    CHECKSUM_BYTES,
    PARALLEL_MIN_BYTES,
    BlockChecksum,
    Hasher,
    Span,
    layer_prefixes,
)
from worker.dataplane.counters import Counters
from worker.dataplane.errors import TierFull
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.base import PutResult, Recount, TierUsage
from worker.dataplane.tiers.host.pool_layout import READY, SHM_DIR, WRITING, checksum_of
from worker.dataplane.tiers.host.reads import HostReads

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


class HostTier(HostReads):
    """Fixed-size slots in a shared-memory pool named `pool_name` (a file in /dev/shm).

    The first process to open a name creates the pool with `capacity_bytes`; later ones map it
    as it is and must use the same layout. Closing never removes the pool (other processes may
    use it); `unlink` does."""

    writes_in_place = True

    def __init__(
        self,
        *,
        layout: BlockLayout,
        capacity_bytes: int,
        pool_name: str,
        counters: Counters | None = None,
        hasher: Hasher | None = None,
        pin: bool | None = None,
        shm_dir: Path = SHM_DIR,
        name: str = "host",
    ) -> None:
        if not _NAME_RE.match(pool_name):
            raise ValueError(f"pool name {pool_name!r} must be letters, digits, '.', '_' or '-'")
        super().__init__(name=name, layout=layout, counters=counters, hasher=hasher, io_threads=1)
        self.path = shm_dir / pool_name
        self._thread_lock = threading.Lock()
        self._lookup = {}
        self._streams = {}
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mm = None
        self._pinned_at = None
        try:
            with self._locked():
                if os.fstat(self._fd).st_size == 0:
                    self._create(capacity_bytes)
                self._attach()
                if int(self._control[2]) % 2:
                    # A process died rebuilding the key index (its lock went with it): redo it.
                    log.warning("host pool %s: rebuilding a key index left half-built", self.path)
                    self._index_rebuild()
                self._reclaim_dead_writers()
            if pin if pin is not None else cuda_available():
                self._pin()
        except BaseException:
            self._detach()
            os.close(self._fd)
            raise

    # -- Tier -----------------------------------------------------------------------------
    def put(self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None) -> PutResult:
        result = self._write([(key, data)], [checksum])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def put_many(
        self,
        items: Sequence[tuple[uuid.UUID, torch.Tensor]],
        *,
        checksums: Sequence[BlockChecksum | None] | None = None,
    ) -> list[Future[PutResult]]:
        """One slot allocation, one parallel copy-and-hash and one publication for the batch."""
        checksums = list(checksums) if checksums is not None else [None] * len(items)
        if len(checksums) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(checksums)} checksums")
        futures: list[Future[PutResult]] = [Future() for _ in items]

        def run() -> None:
            try:
                results: list[PutResult | BaseException] = self._write(list(items), checksums)
            except BaseException as exc:
                results = [exc] * len(items)
            for future, result in zip(futures, results, strict=True):
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

        self._submit(run)
        return futures

    def _write(
        self, items: list[tuple[uuid.UUID, torch.Tensor]], checksums: list[BlockChecksum | None]
    ) -> list[PutResult | BaseException]:
        layout = self.layout
        lb = layout.layer_bytes
        results: list[PutResult | BaseException | None] = [None] * len(items)
        srcs: dict[int, torch.Tensor] = {}
        for i, (_key, data) in enumerate(items):
            try:
                srcs[i] = self._block_bytes(data)
                given = checksums[i]
                if given is not None:
                    self._check_layers(given)
            except ValueError as exc:
                results[i] = exc
        slots: dict[int, int] = {}
        for i in srcs:
            try:
                slots[i] = self._allocate(items[i][0])
            except TierFull as exc:
                results[i] = exc
        try:
            fused = self.hasher.native or len(slots) * layout.block_bytes >= PARALLEL_MIN_BYTES
            hashed: list[tuple[int, Span]] = []
            copies: list[Span] = []
            filled: list[int] = []  # blocks the native call copies, hashes and records
            for i, slot in slots.items():
                key, src = items[i][0], srcs[i]
                if self.hasher.native and src.device.type == "cpu" and checksums[i] is None:
                    filled.append(i)
                    continue
                dst = self._slot_address(slot)
                if src.device.type != "cpu" or not fused:
                    # Device sources come down with one synchronous copy; small batches take a
                    # torch copy and one hash in this thread.
                    self._data[slot * self.slot_bytes : slot * self.slot_bytes + layout.block_bytes].copy_(src)
                    if checksums[i] is None:
                        hashed += [
                            (i, Span(dst + j * lb, lb, prefix))
                            for j, prefix in enumerate(layer_prefixes(key, range(layout.layers)))
                        ]
                    continue
                base = src.data_ptr()
                spans = [
                    Span(base + j * lb, lb, prefix, dst + j * lb)
                    for j, prefix in enumerate(layer_prefixes(key, range(layout.layers)))
                ]
                if checksums[i] is None:
                    # Hashed from the copy in the pool: exactly the bytes readers will verify.
                    hashed += [(i, span) for span in spans]
                else:
                    copies += spans
            # The pool's bytes are read again when the block is, not now: past the cache.
            digests = self.hasher.run([span for _, span in hashed], streaming=True)
            self.hasher.run(copies, digest=False, streaming=True)
            for j in range(0, len(hashed), layout.layers):
                i = hashed[j][0]
                checksums[i] = BlockChecksum.from_layers(items[i][0], digests[j : j + layout.layers])
            if filled:
                filled_spans = len(filled) * layout.layers
                # Written past the cache, as a tier's own storage is (`run` with streaming True).
                sums, block_sums = native.pool_fill(
                    self._pool_geometry,
                    [slots[i] for i in filled],
                    b"".join(items[i][0].bytes for i in filled),
                    [srcs[i].data_ptr() for i in filled],
                    streaming=True,
                    helpers=self.hasher.copy_mode(filled_spans, filled_spans * lb).helpers,
                )
                for n, i in enumerate(filled):
                    checksums[i] = checksum_of(sums, block_sums, n, layout.layers)
            recorded = set(filled)
            for i, slot in slots.items():
                if i in recorded:
                    continue  # the native call wrote the slot's checksums and size
                checksum = checksums[i]
                assert checksum is not None
                self._record(slot, checksum)
        except BaseException:
            with self._locked():
                for slot in slots.values():
                    self._release(slot)
            raise
        self._publish([(items[i][0], slot) for i, slot in slots.items()])
        for i in slots:
            results[i] = PutResult(key=items[i][0], tier=self.name, nbytes=layout.block_bytes, checksum=checksums[i])
        return cast(list[PutResult | BaseException], results)

    def put_from(self, key: uuid.UUID, fill: Callable[[torch.Tensor], BlockChecksum]) -> PutResult:
        """`Tier.put_from` straight into the block's slot: no copy through a buffer of the
        caller's (a block read from another tier lands here once). Until `fill` returns the slot
        is being written, so no reader sees it; if `fill` raises, the slot is freed."""
        layout = self.layout
        slot = self._allocate(key)
        try:
            start = slot * self.slot_bytes
            checksum = fill(self._data[start : start + layout.block_bytes])
            self._check_layers(checksum)
            self._record(slot, checksum)
        except BaseException:
            with self._locked():
                self._release(slot)
            raise
        self._publish([(key, slot)])
        return PutResult(key=key, tier=self.name, nbytes=layout.block_bytes, checksum=checksum)

    def _record(self, slot: int, checksum: BlockChecksum) -> None:
        """Write a filled slot's size and checksums into its metadata (the slot is held)."""
        layout = self.layout
        self._nbytes[slot] = layout.block_bytes
        self._sums[slot] = np.frombuffer(b"".join(checksum.layers), dtype=np.uint8).reshape(
            layout.layers, CHECKSUM_BYTES
        )
        self._block_sums[slot] = np.frombuffer(checksum.block, dtype=np.uint8)

    def _publish(self, stored: list[tuple[uuid.UUID, int]]) -> None:
        """Make filled and recorded slots readable, each replacing any older copy of its key."""
        with self._locked():
            for key, slot in stored:
                for old in self._ready_slots(key):
                    self._release(old)
                self._state[slot] = READY
                self._gen[slot] += 1  # even: stable, readable
        for key, slot in stored:
            self._lookup[key] = slot
        self.counters.add(f"{self.name}.puts", len(stored))
        self.counters.add(f"{self.name}.bytes_written", len(stored) * self.layout.block_bytes)

    def delete(self, key: uuid.UUID) -> bool:
        with self._locked():
            found = self._ready_slots(key)
            for slot in found:
                self._release(slot)
        self._lookup.pop(key, None)
        return bool(found)

    def keys(self) -> list[uuid.UUID]:
        """Keys of every readable block (a consistent snapshot, taken under the pool lock)."""
        with self._locked():
            ready = np.flatnonzero(self._state == READY)
            words = self._keys[ready].copy()
        return [uuid.UUID(bytes=struct.pack("<QQ", int(k0), int(k1))) for k0, k1 in words]

    def usage(self) -> TierUsage:
        states = np.array(self._state)  # one snapshot for all three counts
        ready = int((states == READY).sum())
        writing = int((states == WRITING).sum())
        return TierUsage(
            tier=self.name,
            capacity_bytes=self.slots * self.layout.block_bytes,
            stored_bytes=ready * self.layout.block_bytes,
            pending_bytes=writing * self.layout.block_bytes,
            blocks=ready,
        )

    def recount(self) -> Recount:
        """Usage is read from the slot table at every call, so nothing drifts but slots being
        written by a process that died mid-put: they count as pending for good until a full
        pool or an opening reclaims them. This reclaims them now (a live writer's slot is kept),
        reporting their bytes as drift."""
        with self._locked():
            reclaimed = self._reclaim_dead_writers()
        return Recount(
            tier=self.name, drift_bytes=reclaimed * self.layout.block_bytes, drift_blocks=0, usage=self.usage()
        )

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._lookup.clear()
        self._detach()
        os.close(self._fd)
