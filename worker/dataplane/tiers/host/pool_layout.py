"""The host pool's file in /dev/shm: its layout (header, slot metadata, free-slot stack, key index,
data slots), creating and mapping it, pinning it for CUDA, and the lock that guards its metadata."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from worker.dataplane.buffers import buffer_address, round_up
from worker.dataplane.checksum import CHECKSUM_BYTES, BlockChecksum
from worker.dataplane.layout import DTYPE_CODES
from worker.dataplane.native import PoolGeometry
from worker.dataplane.tiers.base import Tier

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAGIC = b"STRATAHP"
VERSION = 2
"""Layout version of the pool file: 2 added the key index."""
HEADER_BYTES = 4096
PAGE = 4096

_HEADER = struct.Struct("<8sIIQQQIIQQQQQQ")
CONTROL_OFFSET = 512
"""u64 words shared by all processes: [0] = free-stack height, [1] = tombstones in the key
index, [2] = the index's rebuild counter (odd while a rebuild runs)."""

FREE, WRITING, READY = 0, 1, 2


def meta_dtype(layers: int) -> np.dtype:
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


GEOMETRY_FIELDS = ("gen", "state", "key", "nbytes", "checksum", "layer_sums")
"""The metadata record's fields whose offsets PoolGeometry carries (under the same names)."""


def checksum_of(sums: bytes, block_sums: bytes, n: int, layers: int) -> BlockChecksum:
    """Block n's checksum out of the native pool calls' outputs: `layers` layer checksums per
    block back to back, and one block checksum per block."""
    first = n * layers
    return BlockChecksum(
        block=block_sums[n * CHECKSUM_BYTES : (n + 1) * CHECKSUM_BYTES],
        layers=tuple(sums[k * CHECKSUM_BYTES : (k + 1) * CHECKSUM_BYTES] for k in range(first, first + layers)),
    )


def index_buckets(slots: int) -> int:
    """Buckets of a pool's key index: a power of two at least twice the slots, so a probe ends
    at an empty bucket within a few steps while tombstones stay under a quarter of them."""
    return 1 << max(4, (2 * slots - 1).bit_length())


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB ({size} bytes)"


class PoolFile(Tier):
    """The mapped pool file of the host tier and its lock (`HostTier` opens it)."""

    path: Path
    _fd: int
    _thread_lock: threading.Lock
    _mm: mmap.mmap | None
    _pinned_at: int | None
    _lookup: dict[uuid.UUID, int]
    _streams: dict[torch.device, torch.cuda.Stream]

    # -- pool file ------------------------------------------------------------------------
    def _geometry(self, slots: int) -> tuple[int, int, int, int, int]:
        stride = meta_dtype(self.layout.layers).itemsize
        meta_offset = HEADER_BYTES
        free_offset = meta_offset + slots * stride
        index_offset = round_up(free_offset + 4 * slots, 64)
        data_offset = round_up(index_offset + 4 * index_buckets(slots), PAGE)
        return stride, meta_offset, free_offset, index_offset, data_offset

    def _create(self, capacity_bytes: int) -> None:
        slot_bytes = round_up(self.layout.block_bytes, PAGE)
        slots = capacity_bytes // slot_bytes
        if slots < 1:
            raise ValueError(f"host capacity {capacity_bytes} bytes holds no {slot_bytes}-byte slot")
        stride, meta_offset, free_offset, index_offset, data_offset = self._geometry(slots)
        total = data_offset + slots * slot_bytes
        room = os.statvfs(self.path.parent)
        available = room.f_bavail * room.f_frsize + os.fstat(self._fd).st_size
        if total > available:
            # Refused before allocating: the numbers an operator sizes /dev/shm with, not ENOSPC.
            raise ValueError(
                f"the host pool does not fit in {self.path.parent}: it needs {_gib(total)} "
                f"({_gib(slots * slot_bytes)} of slots for host_bytes {_gib(capacity_bytes)}, plus "
                f"{_gib(data_offset)} of header, slot metadata and key index) and {self.path.parent} "
                f"has {_gib(available)} free of {_gib(room.f_blocks * room.f_frsize)}: give it more room "
                "(a container's shm_size, an emptyDir's sizeLimit) or lower host_bytes"
            )
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
            control = np.ndarray((8,), dtype="<u8", buffer=mm, offset=CONTROL_OFFSET)
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
                index_buckets(slots),
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
            or stride != meta_dtype(layers).itemsize
            or buckets != index_buckets(slots)
            or index_offset + 4 * buckets > data_offset
        ):
            raise ValueError(f"host pool {self.path} is truncated or malformed")
        self.slot_bytes, self.slots, self._data_offset = slot_bytes, slots, data_offset
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once, now
        self._mm = mmap.mmap(self._fd, size, flags=flags)
        self._base = buffer_address(self._mm)
        meta = np.ndarray((slots,), dtype=meta_dtype(layers), buffer=self._mm, offset=meta_offset)
        self._meta = meta
        self._gen = meta["gen"]
        self._state = meta["state"]
        self._pid = meta["pid"]
        self._keys = meta["key"]
        self._nbytes = meta["nbytes"]
        self._sums = meta["layer_sums"]
        self._block_sums = meta["checksum"]
        self._free = np.ndarray((slots,), dtype="<u4", buffer=self._mm, offset=free_offset)
        self._control = np.ndarray((8,), dtype="<u8", buffer=self._mm, offset=CONTROL_OFFSET)
        self._index = np.ndarray((buckets,), dtype="<u4", buffer=self._mm, offset=index_offset)
        self._index_mask = buckets - 1
        fields = meta.dtype.fields
        assert fields is not None
        self._pool_geometry = PoolGeometry(
            meta=self._base + meta_offset,
            stride=stride,
            **{name: fields[name][1] for name in GEOMETRY_FIELDS},
            data=self._base + data_offset,
            slot_bytes=slot_bytes,
            layers=layers,
            layer_bytes=layer_bytes,
            block_bytes=self.layout.block_bytes,
            ready=READY,
        )
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=data_offset, count=slots * slot_bytes)

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
        err = int(torch.cuda.cudart().cudaHostRegister(address, size, 1))  # 1 = cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of host pool {self.path} failed with cudaError {err}")
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
