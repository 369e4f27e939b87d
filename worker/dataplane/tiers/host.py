"""L2 host tier: a DRAM pool in POSIX shared memory that every process on the node opens at once.

The pool is one file under /dev/shm (the engine and the node's Celery worker map the same pages):

    [header 4 KiB][slot metadata x n][free-slot stack x n][key index x 2n+][4 KiB-aligned data slots x n]

* Allocation and publication happen under an exclusive ``flock`` on the pool file (plus a
  thread lock: flock does not exclude threads sharing one descriptor). The lock covers only
  metadata updates; bytes are copied outside it.
* The key index is an open-addressing table of slot numbers, hashed by key, that holds every
  slot with a key (being written or readable): finding a key's slots costs a few probes at any
  pool size, where a scan of every slot cost ~3 us per thousand slots on each put, miss and
  delete. It changes under the lock; readers probe it without one. A removed entry becomes a
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

import contextlib
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import numpy as np
import torch

from worker.dataplane.buffers import buffer_address, cuda_available, round_up
from worker.dataplane.checksum import (
    CHECKSUM_BYTES,
    PARALLEL_MIN_BYTES,
    BlockChecksum,
    ChecksumEngine,
    Span,
    layer_prefixes,
)
from worker.dataplane.counters import Counters
from worker.dataplane.errors import BlockCorrupt, BlockMissing, TierFull
from worker.dataplane.layout import DTYPE_CODES, BlockLayout
from worker.dataplane.native import (
    READ_BLOCK_SUM,
    READ_OK,
    READ_SIZE,
    READ_TORN,
    READ_UNSETTLED,
    PoolGeometry,
)
from worker.dataplane.tiers.base import PutResult, ReadResult, Tier, TierUsage

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAGIC = b"STRATAHP"
VERSION = 2
"""Layout version of the pool file: 2 added the key index."""
HEADER_BYTES = 4096
PAGE = 4096

_HEADER = struct.Struct("<8sIIQQQIIQQQQQQ")
_CONTROL_OFFSET = 512
"""u64 words shared by all processes: [0] = free-stack height, [1] = tombstones in the key
index, [2] = the index's rebuild counter (odd while a rebuild runs)."""

INDEX_EMPTY, INDEX_GONE = 0, 0xFFFFFFFF
"""Key-index buckets hold slot + 1, or one of these (never used, or a removed entry)."""
_U64 = (1 << 64) - 1

FREE, WRITING, READY = 0, 1, 2

READ_ATTEMPTS = 16
"""A read retried this many times because writers kept changing the slot is reported as a miss."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


def _meta_dtype(layers: int) -> np.dtype:
    fields = [
        ("gen", "<u8"),
        ("state", "<u4"),
        ("pid", "<u4"),
        ("key", "<u8", (2,)),
        ("nbytes", "<u8"),
        ("checksum", "u1", (CHECKSUM_BYTES,)),
        ("layer_sums", "u1", (layers, CHECKSUM_BYTES)),
    ]
    base = np.dtype(fields)
    names, by_name = base.names, base.fields
    assert names is not None and by_name is not None  # a structured dtype has both
    # Pad records to a cache line so two slots' generations never share one.
    return np.dtype(
        {
            "names": names,
            "formats": [by_name[n][0] for n in names],
            "offsets": [by_name[n][1] for n in names],
            "itemsize": round_up(base.itemsize, 64),
        }
    )


_GEOMETRY_FIELDS = ("gen", "state", "key", "nbytes", "checksum", "layer_sums")
"""The metadata record's fields whose offsets PoolGeometry carries (under the same names)."""


def _checksum_of(sums: bytes, block_sums: bytes, n: int, layers: int) -> BlockChecksum:
    """Block n's checksum out of the native pool calls' outputs: `layers` layer checksums per
    block back to back, and one block checksum per block."""
    first = n * layers
    return BlockChecksum(
        block=block_sums[n * CHECKSUM_BYTES : (n + 1) * CHECKSUM_BYTES],
        layers=tuple(
            sums[k * CHECKSUM_BYTES : (k + 1) * CHECKSUM_BYTES] for k in range(first, first + layers)
        ),
    )


def _key_words(key: uuid.UUID) -> tuple[int, int]:
    return struct.unpack("<QQ", key.bytes)


def _index_buckets(slots: int) -> int:
    """Buckets of a pool's key index: a power of two at least twice the slots, so a probe ends
    at an empty bucket within a few steps while tombstones stay under a quarter of them."""
    return 1 << max(4, (2 * slots - 1).bit_length())


def _mix(x: int) -> int:
    """A 64-bit finaliser (MurmurHash3's fmix64): every input bit moves every output bit."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _U64
    return x ^ (x >> 33)


def _bucket(k0: int, k1: int, mask: int) -> int:
    # Both words, fully mixed: keys in use are uniform hashes, but keys that differ only in a
    # few high bytes (sequential ids) must spread over the buckets too.
    return _mix(k0 ^ _mix(k1)) & mask


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostTier(Tier):
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
        engine: ChecksumEngine | None = None,
        pin: bool | None = None,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        if not _NAME_RE.match(pool_name):
            raise ValueError(f"pool name {pool_name!r} must be letters, digits, '.', '_' or '-'")
        super().__init__(name="host", layout=layout, counters=counters, engine=engine, io_threads=1)
        self.path = shm_dir / pool_name
        self._thread_lock = threading.Lock()
        self._lookup: dict[uuid.UUID, int] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mm: mmap.mmap | None = None
        self._pinned_at: int | None = None
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

    # -- pool file ------------------------------------------------------------------------
    def _geometry(self, slots: int) -> tuple[int, int, int, int, int]:
        stride = _meta_dtype(self.layout.layers).itemsize
        meta_offset = HEADER_BYTES
        free_offset = meta_offset + slots * stride
        index_offset = round_up(free_offset + 4 * slots, 64)
        data_offset = round_up(index_offset + 4 * _index_buckets(slots), PAGE)
        return stride, meta_offset, free_offset, index_offset, data_offset

    def _create(self, capacity_bytes: int) -> None:
        slot_bytes = round_up(self.layout.block_bytes, PAGE)
        slots = capacity_bytes // slot_bytes
        if slots < 1:
            raise ValueError(
                f"host capacity {capacity_bytes} bytes holds no {slot_bytes}-byte slot"
            )
        stride, meta_offset, free_offset, index_offset, data_offset = self._geometry(slots)
        total = data_offset + slots * slot_bytes
        try:
            # Allocate every page now: a pool that does not fit in /dev/shm fails here, loudly,
            # instead of with SIGBUS on some later write.
            os.posix_fallocate(self._fd, 0, total)
        except OSError as exc:
            os.ftruncate(self._fd, 0)
            raise OSError(
                exc.errno,
                f"cannot allocate a {total}-byte host pool at {self.path}: {exc.strerror}",
            ) from exc
        with mmap.mmap(self._fd, data_offset) as mm:
            free = np.ndarray((slots,), dtype="<u4", buffer=mm, offset=free_offset)
            free[:] = np.arange(slots - 1, -1, -1, dtype="<u4")  # pop yields slot 0 first
            control = np.ndarray((8,), dtype="<u8", buffer=mm, offset=_CONTROL_OFFSET)
            control[0] = slots
            del free, control
            # The magic goes in last: an opener never sees a half-initialised header.
            mm[: _HEADER.size] = _HEADER.pack(
                MAGIC,
                VERSION,
                0,
                slot_bytes,
                slots,
                self.layout.layer_bytes,
                self.layout.layers,
                DTYPE_CODES[self.layout.dtype],
                meta_offset,
                stride,
                free_offset,
                data_offset,
                index_offset,
                _index_buckets(slots),
            )
        log.info("created host pool %s: %d slots of %d bytes", self.path, slots, slot_bytes)

    def _attach(self) -> None:
        size = os.fstat(self._fd).st_size
        with mmap.mmap(self._fd, HEADER_BYTES) as mm:
            header = _HEADER.unpack(mm[: _HEADER.size])
        (
            magic,
            version,
            _flags,
            slot_bytes,
            slots,
            layer_bytes,
            layers,
            dtype_code,
            meta_offset,
            stride,
            free_offset,
            data_offset,
            index_offset,
            buckets,
        ) = header
        if magic != MAGIC:
            raise ValueError(f"{self.path} is not a strata host pool")
        if version != VERSION:
            raise ValueError(
                f"host pool {self.path} has layout version {version}, this release reads "
                f"version {VERSION}: stop the processes using it and remove the file (it holds "
                "only cached blocks) so that the next start creates it anew"
            )
        if (layer_bytes, layers, dtype_code) != (
            self.layout.layer_bytes,
            self.layout.layers,
            DTYPE_CODES[self.layout.dtype],
        ):
            raise ValueError(
                f"host pool {self.path} holds blocks of another layout ({layers} layers x {layer_bytes} bytes)"
            )
        if (
            size < data_offset + slots * slot_bytes
            or stride != _meta_dtype(layers).itemsize
            or buckets != _index_buckets(slots)
            or index_offset + 4 * buckets > data_offset
        ):
            raise ValueError(f"host pool {self.path} is truncated or malformed")
        self.slot_bytes, self.slots, self._data_offset = slot_bytes, slots, data_offset
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once, now
        self._mm = mmap.mmap(self._fd, size, flags=flags)
        self._base = buffer_address(self._mm)
        meta = np.ndarray((slots,), dtype=_meta_dtype(layers), buffer=self._mm, offset=meta_offset)
        self._meta = meta
        self._gen = meta["gen"]
        self._state = meta["state"]
        self._pid = meta["pid"]
        self._keys = meta["key"]
        self._nbytes = meta["nbytes"]
        self._sums = meta["layer_sums"]
        self._block_sums = meta["checksum"]
        self._free = np.ndarray((slots,), dtype="<u4", buffer=self._mm, offset=free_offset)
        self._control = np.ndarray((8,), dtype="<u8", buffer=self._mm, offset=_CONTROL_OFFSET)
        self._index = np.ndarray((buckets,), dtype="<u4", buffer=self._mm, offset=index_offset)
        self._index_mask = buckets - 1
        fields = meta.dtype.fields
        assert fields is not None
        self._pool_geometry = PoolGeometry(
            meta=self._base + meta_offset,
            stride=stride,
            **{name: fields[name][1] for name in _GEOMETRY_FIELDS},
            data=self._base + data_offset,
            slot_bytes=slot_bytes,
            layers=layers,
            layer_bytes=layer_bytes,
            block_bytes=self.layout.block_bytes,
            ready=READY,
        )
        self._data = torch.frombuffer(
            self._mm, dtype=torch.uint8, offset=data_offset, count=slots * slot_bytes
        )

    def _detach(self) -> None:
        if self._pinned_at is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_at)
            self._pinned_at = None
        for name in (
            "_meta",
            "_gen",
            "_state",
            "_pid",
            "_keys",
            "_nbytes",
            "_sums",
            "_block_sums",
            "_free",
            "_control",
            "_index",
            "_data",
            "_pool_geometry",  # addresses in the mapping: a read after close must not use them
        ):
            self.__dict__.pop(name, None)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # A caller still holds a zero-copy view; the mapping goes when that view does.
                log.warning(
                    "host pool %s still has views; leaving the mapping to the garbage collector",
                    self.path,
                )
            self._mm = None

    def _pin(self) -> None:
        address, size = self._base + self._data_offset, self.slots * self.slot_bytes
        err = int(
            torch.cuda.cudart().cudaHostRegister(address, size, 1)
        )  # 1 = cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister of host pool {self.path} failed with cudaError {err}"
            )
        self._pinned_at = address

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        """Remove the pool's name; processes that have it mapped keep their mapping."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # -- slot bookkeeping (callers hold the lock) -------------------------------------------
    def _slot_address(self, slot: int) -> int:
        return self._base + self._data_offset + slot * self.slot_bytes

    def _ready_slots(self, key: uuid.UUID) -> list[int]:
        """The slots holding `key` READY (more than one only while a put publishes). Exact under
        the lock; without it, a rebuild of the index racing the probe falls back to a scan."""
        k0, k1 = _key_words(key)
        slots = self._index_slots(k0, k1)
        if slots is None:
            found = np.flatnonzero(
                (self._keys[:, 0] == k0) & (self._keys[:, 1] == k1) & (self._state == READY)
            )
            return [int(slot) for slot in found]
        return [slot for slot in slots if self._state[slot] == READY]

    # -- key index (changed under the lock; probed without it) ------------------------------
    def _index_slots(self, k0: int, k1: int) -> list[int] | None:
        """The slots whose key is (k0, k1), from the index; None when a rebuild ran meanwhile."""
        control, index, keys, mask = self._control, self._index, self._keys, self._index_mask
        rebuilds = int(control[2])
        if rebuilds % 2:
            return None
        found = []
        bucket = _bucket(k0, k1, mask)
        for _probe in range(mask + 1):
            entry = int(index[bucket])
            if entry == INDEX_EMPTY:
                break
            if entry != INDEX_GONE:
                slot = entry - 1
                if keys[slot, 0] == k0 and keys[slot, 1] == k1:
                    found.append(slot)
            bucket = (bucket + 1) & mask
        if int(control[2]) != rebuilds:
            return None
        return found

    def _index_add(self, slot: int, k0: int, k1: int) -> None:
        index, mask = self._index, self._index_mask
        bucket = _bucket(k0, k1, mask)
        while True:  # at most half the buckets hold a slot, so a free one is near
            entry = int(index[bucket])
            if entry == INDEX_EMPTY or entry == INDEX_GONE:
                if entry == INDEX_GONE:
                    self._control[1] -= 1
                index[bucket] = slot + 1
                return
            bucket = (bucket + 1) & mask

    def _index_remove(self, slot: int) -> None:
        index, mask = self._index, self._index_mask
        bucket = _bucket(int(self._keys[slot, 0]), int(self._keys[slot, 1]), mask)
        for _probe in range(mask + 1):
            entry = int(index[bucket])
            if entry == slot + 1:
                index[bucket] = INDEX_GONE
                self._control[1] += 1
                if int(self._control[1]) > (mask + 1) // 4:
                    self._index_rebuild()
                return
            if entry == INDEX_EMPTY:
                break
            bucket = (bucket + 1) & mask
        self._index_rebuild()  # the slot was not indexed: the table is not what it should be

    def _index_rebuild(self) -> None:
        """Index every slot that has a key afresh, without tombstones."""
        control = self._control
        control[2] = int(control[2]) | 1  # odd: readers probing now fall back to a scan
        self._index[:] = INDEX_EMPTY
        for slot in np.flatnonzero(self._state != FREE):
            self._index_add(int(slot), int(self._keys[slot, 0]), int(self._keys[slot, 1]))
        control[1] = 0
        control[2] = int(control[2]) + 1

    def _release(self, slot: int) -> None:
        if self._gen[slot] % 2 == 0:
            self._gen[slot] += 1
        keyed = self._state[slot] != FREE
        self._state[slot] = FREE  # first: a rebuild the removal may run skips this slot
        if keyed:
            self._index_remove(slot)
        self._keys[slot] = 0
        self._nbytes[slot] = 0
        self._pid[slot] = 0
        self._gen[slot] += 1
        top = int(self._control[0])
        self._free[top] = slot
        self._control[0] = top + 1

    def _reclaim_dead_writers(self) -> int:
        reclaimed = 0
        for slot in np.flatnonzero(self._state == WRITING):
            if not _pid_alive(int(self._pid[slot])):
                self._release(int(slot))
                reclaimed += 1
        if reclaimed:
            log.warning(
                "host pool %s: reclaimed %d slots left by crashed writers", self.path, reclaimed
            )
        return reclaimed

    def _allocate(self, key: uuid.UUID) -> int:
        with self._locked():
            if int(self._control[0]) == 0 and not self._reclaim_dead_writers():
                self.counters.add(f"{self.name}.full")
                raise TierFull(self.name, needed=self.layout.block_bytes, free=0)
            top = int(self._control[0]) - 1
            slot = int(self._free[top])
            self._control[0] = top
            self._gen[slot] += 1  # odd: the slot is changing
            self._state[slot] = WRITING
            self._pid[slot] = os.getpid()
            k0, k1 = _key_words(key)
            self._keys[slot] = (k0, k1)
            self._index_add(slot, k0, k1)
            return slot

    # -- Tier -----------------------------------------------------------------------------
    def put(
        self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None
    ) -> PutResult:
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
            fused = self.engine.native or len(slots) * layout.block_bytes >= PARALLEL_MIN_BYTES
            hashed: list[tuple[int, Span]] = []
            copies: list[Span] = []
            filled: list[int] = []  # blocks the native call copies, hashes and records
            for i, slot in slots.items():
                key, src = items[i][0], srcs[i]
                if self.engine.native and src.device.type == "cpu" and checksums[i] is None:
                    filled.append(i)
                    continue
                dst = self._slot_address(slot)
                if src.device.type != "cpu" or not fused:
                    # Device sources come down with one synchronous copy; small batches take a
                    # torch copy and one hash in this thread.
                    self._data[
                        slot * self.slot_bytes : slot * self.slot_bytes + layout.block_bytes
                    ].copy_(src)
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
            digests = self.engine.run([span for _, span in hashed], streaming=True)
            self.engine.run(copies, digest=False, streaming=True)
            for j in range(0, len(hashed), layout.layers):
                i = hashed[j][0]
                checksums[i] = BlockChecksum.from_layers(
                    items[i][0], digests[j : j + layout.layers]
                )
            if filled:
                sums, block_sums = self.engine.pool_fill(
                    self._pool_geometry,
                    [slots[i] for i in filled],
                    b"".join(items[i][0].bytes for i in filled),
                    [srcs[i].data_ptr() for i in filled],
                    lb,
                )
                for n, i in enumerate(filled):
                    checksums[i] = _checksum_of(sums, block_sums, n, layout.layers)
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
            results[i] = PutResult(
                key=items[i][0], tier=self.name, nbytes=layout.block_bytes, checksum=checksums[i]
            )
        return cast(list[PutResult | BaseException], results)

    def put_from(
        self, key: uuid.UUID, fill: Callable[[torch.Tensor], BlockChecksum]
    ) -> PutResult:
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

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        result = self._read([key], range(self.layout.layers), [self._block_bytes(out)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        return self._read_async(self._read, keys, layers, outs)

    def _settled(self, slot: int, key: uuid.UUID) -> int | None:
        """The slot's generation when it holds `key`, READY and not being changed; else None
        (a writer or an eviction is at work: try again)."""
        generation = int(self._gen[slot])
        k0, k1 = _key_words(key)
        if (
            generation % 2
            or self._state[slot] != READY
            or self._keys[slot, 0] != k0
            or self._keys[slot, 1] != k1
        ):
            return None
        return generation

    def _layer_sums(self, slot: int, layers: range) -> list[bytes]:
        """The stored checksums of `layers` of the block in `slot`, one 16-byte digest each."""
        stored = self._sums[slot, layers.start : layers.stop].tobytes()
        return [stored[j : j + CHECKSUM_BYTES] for j in range(0, len(stored), CHECKSUM_BYTES)]

    def _find(self, key: uuid.UUID) -> int | None:
        slot = self._lookup.get(key)
        if slot is not None:
            k0, k1 = _key_words(key)
            if (
                self._keys[slot, 0] == k0
                and self._keys[slot, 1] == k1
                and self._state[slot] == READY
            ):
                return slot
        found = self._ready_slots(key)
        if not found:
            self._lookup.pop(key, None)
            return None
        if len(self._lookup) > 4 * self.slots:
            self._lookup.clear()  # entries of blocks other processes evicted pile up otherwise
        slot = found[0]
        self._lookup[key] = slot
        return slot

    def _read(
        self, keys: list[uuid.UUID], layers: range, dsts: list[torch.Tensor]
    ) -> list[ReadResult | Exception]:
        if self.engine.native and all(dst.device.type == "cpu" for dst in dsts):
            return self._read_native(keys, layers, dsts)
        layout = self.layout
        layer_bytes = layout.layer_bytes
        offset, nbytes = layout.span(layers)
        whole = len(layers) == layout.layers
        results: list[ReadResult | Exception | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for _attempt in range(READ_ATTEMPTS):
            if not pending:
                break
            retry: list[int] = []
            batch: list[tuple[int, int, int, list[bytes], int, bytes]] = []
            spans: list[Span] = []
            device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            # Copy and hash chunk by chunk on the engine's threads (the fused routine does it in
            # one pass at any size). Without it, small batches take one torch copy, then one
            # hash in this thread (a thread hand-off would cost more).
            fused = self.engine.native or len(pending) * nbytes >= PARALLEL_MIN_BYTES
            for i in pending:
                key = keys[i]
                slot = self._find(key)
                if slot is None:
                    results[i] = BlockMissing(key, tier=self.name)
                    continue
                generation = self._settled(slot, key)
                if generation is None:
                    retry.append(i)
                    continue
                want = self._layer_sums(slot, layers)
                stored_nbytes = int(self._nbytes[slot])
                block_sum = self._block_sums[slot].tobytes()
                batch.append((i, slot, generation, want, stored_nbytes, block_sum))
                src = self._slot_address(slot) + offset
                dst = dsts[i]
                start = slot * self.slot_bytes + offset
                if dst.device.type != "cpu":
                    # Hash the pool's bytes while the GPU copies them: the generation check
                    # after both proves they were the same bytes.
                    device_copies.append((dst, self._data[start : start + nbytes]))
                    hash_at, copy_to = src, None
                elif fused:
                    hash_at, copy_to = src, dst.data_ptr()
                else:
                    host_copies.append((dst, self._data[start : start + nbytes]))
                    hash_at, copy_to = dst.data_ptr(), None
                spans += [
                    Span(
                        hash_at + j * layer_bytes,
                        layer_bytes,
                        prefix,
                        None if copy_to is None else copy_to + j * layer_bytes,
                    )
                    for j, prefix in enumerate(layer_prefixes(key, layers))
                ]
            streams = self._copy_to_devices(device_copies)
            for dst, src_view in host_copies:
                dst.copy_(src_view)  # torch's own threads; the hash below reads the copy
            digests = self.engine.run(spans)
            for stream in streams:
                stream.synchronize()
            cursor = 0
            for i, slot, generation, want, stored_nbytes, block_sum in batch:
                got = digests[cursor : cursor + len(layers)]
                cursor += len(layers)
                if int(self._gen[slot]) != generation:
                    # A writer or an eviction touched the slot during the copy: discard, retry.
                    self.counters.add(f"{self.name}.torn_retries")
                    retry.append(i)
                    continue
                bad = next(
                    (layer for layer, g, w in zip(layers, got, want, strict=True) if g != w), None
                )
                if stored_nbytes != layout.block_bytes:
                    results[i] = self._quarantine(
                        keys[i], slot, generation, f"slot records {stored_nbytes} bytes"
                    )
                elif bad is None:
                    self.counters.add(f"{self.name}.hits")
                    self.counters.add(f"{self.name}.bytes_read", nbytes)
                    checksum = BlockChecksum(block=block_sum, layers=tuple(want)) if whole else None
                    if checksum is not None and not checksum.consistent(keys[i]):
                        results[i] = self._quarantine(
                            keys[i], slot, generation, "block checksum does not match its layers"
                        )
                        continue
                    results[i] = ReadResult(
                        key=keys[i], tier=self.name, layers=layers, nbytes=nbytes, checksum=checksum
                    )
                else:
                    results[i] = self._quarantine(
                        keys[i], slot, generation, f"layer {bad} checksum mismatch"
                    )
            pending = retry
        return self._finish_read(keys, results, pending)

    def _read_native(
        self, keys: list[uuid.UUID], layers: range, dsts: list[torch.Tensor]
    ) -> list[ReadResult | Exception]:
        """`_read` into host memory in one native call per attempt (`native.pool_read`): the
        same checks in the same order (slot stable and holding the key, copy and hash, generation
        unchanged, recorded size, layer checksums, block checksum), without the interpreter's
        cost per block and per layer."""
        layout = self.layout
        nbytes = len(layers) * layout.layer_bytes
        whole = len(layers) == layout.layers
        results: list[ReadResult | Exception | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        cached = self._lookup
        hits = 0
        for attempt in range(READ_ATTEMPTS):
            if not pending:
                break
            asked: list[int] = []
            slots: list[int] = []
            for i in pending:
                # First from this process's cache, unchecked (the native call checks the slot
                # itself); a retry looks the key up afresh.
                slot = cached.get(keys[i]) if attempt == 0 else None
                if slot is None:
                    slot = self._find(keys[i])
                    if slot is None:
                        results[i] = BlockMissing(keys[i], tier=self.name)
                        continue
                asked.append(i)
                slots.append(slot)
            if not asked:
                pending = []
                break
            statuses, generations, sums, block_sums = self.engine.pool_read(
                self._pool_geometry,
                slots,
                b"".join(keys[i].bytes for i in asked),
                [dsts[i].data_ptr() for i in asked],
                layers,
                layout.layer_bytes,
            )
            retry: list[int] = []
            for n, (i, slot, status) in enumerate(zip(asked, slots, statuses, strict=True)):
                if status == READ_OK:
                    hits += 1
                    checksum = _checksum_of(sums, block_sums, n, layout.layers) if whole else None
                    results[i] = ReadResult(
                        key=keys[i], tier=self.name, layers=layers, nbytes=nbytes, checksum=checksum
                    )
                elif status in (READ_UNSETTLED, READ_TORN):
                    if status == READ_TORN:
                        # A writer or an eviction touched the slot during the copy: discard, retry.
                        self.counters.add(f"{self.name}.torn_retries")
                    retry.append(i)
                else:
                    if status == READ_SIZE:
                        reason = f"slot records {int(self._nbytes[slot])} bytes"
                    elif status == READ_BLOCK_SUM:
                        reason = "block checksum does not match its layers"
                    else:
                        reason = f"layer {status - 1} checksum mismatch"
                    results[i] = self._quarantine(keys[i], slot, generations[n], reason)
            pending = retry
        if hits:
            self.counters.add(f"{self.name}.hits", hits)
            self.counters.add(f"{self.name}.bytes_read", hits * nbytes)
        return self._finish_read(keys, results, pending)

    def _finish_read(
        self,
        keys: list[uuid.UUID],
        results: list[ReadResult | Exception | None],
        contended: list[int],
    ) -> list[ReadResult | Exception]:
        """The reads writers kept changing (`contended`, out of attempts) become misses; misses
        are counted."""
        for i in contended:
            self.counters.add(f"{self.name}.contended")
            results[i] = BlockMissing(keys[i], tier=self.name)
        misses = sum(isinstance(result, BlockMissing) for result in results)
        if misses:
            self.counters.add(f"{self.name}.misses", misses)
        return cast(list[ReadResult | Exception], results)

    def _copy_to_devices(
        self, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.cuda.Stream]:
        """Queue pool-to-GPU copies on this tier's stream per device (the pool is pinned, so they
        run while the CPU hashes the same bytes); returns the streams to wait on."""
        used: dict[torch.device, torch.cuda.Stream] = {}
        for dst, src in copies:
            stream = self._streams.get(dst.device)
            if stream is None:
                stream = self._streams[dst.device] = torch.cuda.Stream(dst.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            used[dst.device] = stream
        return list(used.values())

    def _quarantine(self, key: uuid.UUID, slot: int, generation: int, reason: str) -> BlockCorrupt:
        self.counters.add(f"{self.name}.corrupt")
        with self._locked():
            # Only this copy: a writer may have stored a good one under the key meanwhile.
            if int(self._gen[slot]) == generation and self._state[slot] == READY:
                self._release(slot)
                self.counters.add(f"{self.name}.quarantined")
        return BlockCorrupt(key, tier=self.name, reason=reason)

    def checksum(self, key: uuid.UUID) -> BlockChecksum:
        """The checksum stored with a block (from its slot; the data is not read). Read between
        two looks at the slot's generation, so a writer or an eviction meanwhile is never mixed in."""
        for _attempt in range(READ_ATTEMPTS):
            slot = self._find(key)
            if slot is None:
                break
            generation = self._settled(slot, key)
            if generation is None:
                continue
            layers = self._layer_sums(slot, range(self.layout.layers))
            block_sum = self._block_sums[slot].tobytes()
            if int(self._gen[slot]) == generation:
                return BlockChecksum(block=block_sum, layers=tuple(layers))
        raise BlockMissing(key, tier=self.name)

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The slot's data bytes as stored (the recorded size of them), copied between two looks
        at its generation so a writer or an eviction meanwhile is never mixed in."""
        for _attempt in range(READ_ATTEMPTS):
            slot = self._find(key)
            if slot is None:
                return None
            generation = self._settled(slot, key)
            if generation is None:
                continue
            start = slot * self.slot_bytes
            nbytes = min(int(self._nbytes[slot]), self.slot_bytes)
            data = bytes(self._data[start : start + nbytes].numpy())
            if int(self._gen[slot]) == generation:
                return data
        return None

    def contains(self, key: uuid.UUID) -> bool:
        return self._find(key) is not None

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

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._lookup.clear()
        self._detach()
        os.close(self._fd)
