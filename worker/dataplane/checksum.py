"""Block checksums (xxh3-128 per layer, chained into one per block) and the fused copy+verify hasher.

A block's checksum is ``xxh3_128(key | c_0 | ... | c_{L-1})`` where ``c_l = xxh3_128(key | l |
layer l bytes)``: it covers the key and every byte, like a flat hash would, and lets a tier verify
a single layer it reads without touching the rest of the block."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import xxhash

from worker.dataplane.buffers import address_view, tensor_bytes
from worker.dataplane.layout import BlockLayout
from worker.dataplane.native import CopyBatch, start_helpers
from worker.dataplane.native import available as native_available

CHECKSUM_BYTES = 16

CHUNK_BYTES = 512 * 1024
"""Copy-then-hash granule of the Python fallback (the fused routine in `native` uses its own,
copying each 4 KiB of the source, then hashing it from L1). Each chunk is hashed right after
it is copied, while it is still in cache: much smaller chunks drown in per-call overhead, larger
ones fall out of cache, and copying a whole block before hashing it is slower still
(benchmarks/README.md)."""

PARALLEL_MIN_BYTES = 8 * 1024 * 1024
"""Below this, handing work to another Python thread costs more than it saves: waking a pool
thread and trading the GIL takes a good share of the time a small block's copy and hash take on
one core (benchmarks/README.md).
The fused routine's own helper threads (`native.start_helpers`) stay awake between copies and
join within a microsecond, so with them the hasher shares out anything from HELPERS_MIN_BYTES."""

HELPERS_MIN_BYTES = 256 * 1024
"""Smallest verified copy the native helper threads share: one layer of a small model's block,
so even a 2 MiB block of 256 KiB layers is shared out (benchmarks/README.md)."""


def _last_level_cache_bytes() -> int:
    """The size of the CPU's last-level cache (sysfs), or 32 MiB where it cannot be read."""
    best = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if kind != "Instruction" and size and size[-1] in units and size[:-1].isdigit():
            best = max(best, int(size[:-1]) * units[size[-1]])
    return best or 32 * 1024 * 1024


CACHED_COPY_MAX_BYTES = min(_last_level_cache_bytes() // 4, 8 * 1024 * 1024)
"""A copy this small writes its destination through the cache, where its reader (the model
layer that loads it, the next hash) finds it; a larger one uses streaming stores, since it
would push everything else out of the cache anyway and skipping the destination's
read-for-ownership saves a third of the memory traffic (the rule memcpy itself follows). A
quarter of the last-level cache, and never more than 8 MiB: in a virtual machine that cache is
the whole socket's, shared with every other guest on it, and a guest may report hundreds of
MiB; cached copies of large blocks also push the reading thread's own state out of its L2
(figures in benchmarks/README.md)."""


def layer_prefix(key: uuid.UUID, layer: int) -> bytes:
    return key.bytes + layer.to_bytes(4, "little")


_LAYER_SUFFIXES = [layer.to_bytes(4, "little") for layer in range(256)]


def layer_prefixes(key: uuid.UUID, layers: range) -> list[bytes]:
    """`layer_prefix(key, l)` for every l in `layers` (a block read builds one per layer)."""
    head = key.bytes
    if layers.start >= 0 and layers.stop <= len(_LAYER_SUFFIXES):
        return [head + _LAYER_SUFFIXES[layer] for layer in layers]
    return [head + layer.to_bytes(4, "little") for layer in layers]


def layer_checksum(key: uuid.UUID, layer: int, data: memoryview | bytes) -> bytes:
    h = xxhash.xxh3_128(layer_prefix(key, layer))
    h.update(data)
    return h.digest()


def block_checksum(key: uuid.UUID, layer_checksums: Sequence[bytes]) -> bytes:
    return xxhash.xxh3_128(key.bytes + b"".join(layer_checksums)).digest()


@dataclasses.dataclass(frozen=True)
class BlockChecksum:
    """The checksum of a block and of each of its layers (16 bytes each)."""

    block: bytes
    layers: tuple[bytes, ...]

    @classmethod
    def from_layers(cls, key: uuid.UUID, layers: Sequence[bytes]) -> BlockChecksum:
        return cls(block=block_checksum(key, layers), layers=tuple(layers))

    @classmethod
    def unpack(cls, raw: bytes, *, layers: int) -> BlockChecksum:
        """Inverse of `pack`."""
        if len(raw) != CHECKSUM_BYTES * (layers + 1):
            raise ValueError(f"expected {CHECKSUM_BYTES * (layers + 1)} bytes of checksums, got {len(raw)}")
        sums = tuple(raw[i : i + CHECKSUM_BYTES] for i in range(CHECKSUM_BYTES, len(raw), CHECKSUM_BYTES))
        return cls(block=raw[:CHECKSUM_BYTES], layers=sums)

    def pack(self) -> bytes:
        return self.block + b"".join(self.layers)

    @property
    def hex(self) -> str:
        return self.block.hex()

    def consistent(self, key: uuid.UUID) -> bool:
        """True when the block checksum matches the layer checksums under `key`."""
        return len(self.block) == CHECKSUM_BYTES and self.block == block_checksum(key, self.layers)


class Span(NamedTuple):
    """One layer's worth of work for the hasher: hash `nbytes` at `src` (after `prefix`), and copy
    them to `dst` when it is set, chunk by chunk, so the digest covers exactly the bytes copied
    (callers reading memory another process may change check a generation around the call).
    Addresses are raw CPU pointers kept alive by the caller. (A tuple: a block read builds one
    per layer, and a frozen dataclass costs a microsecond each to build.)"""

    src: int
    nbytes: int
    prefix: bytes = b""
    dst: int | None = None


class CopyMode(NamedTuple):
    """How the hasher runs a batch of verified copies (`Hasher.copy_mode`)."""

    streaming: bool
    """Copies write past the cache (streaming stores)."""
    helpers: bool
    """The batch is shared with the process's native helper threads."""


class Hasher:
    """Copies and hashes spans of memory on a few threads, chunk by chunk, so a verified copy
    runs at memcpy speed. The caller's thread does a share of the work itself.

    With the fused routine in `native`, the caller and the process's native helper threads
    (`threads` - 1 of them, started with the first such hasher) work through one prepared batch
    without the interpreter lock, claiming a span at a time: a busy Python thread elsewhere in
    the process cannot slow them, a helper that wakes late takes less work, and helpers that
    stay awake between copies make even one small block's copy a shared one. `native` False (or
    the routine not built) splits the spans into fixed shares for a Python pool and hashes in
    Python, giving up the lock per chunk."""

    def __init__(
        self,
        *,
        threads: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        native: bool | None = None,
    ) -> None:
        if threads is None or threads <= 0:
            threads = min(4, os.cpu_count() or 1)
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        if native and not native_available():
            raise RuntimeError("the fused copy-and-hash library is not built")
        self.native = native_available() if native is None else native
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="strata-copy") if threads > 1 else None
        # Process-wide native threads that share verified copies with the caller (the Python
        # pool above keeps run_async and the Python fallback).
        self._helpers = start_helpers(threads - 1) if self.native and threads > 1 else 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, spans: Sequence[Span], *, digest: bool = True, streaming: bool | None = None) -> list[bytes]:
        """Copy (where `dst` is set) and hash every span; returns one 16-byte digest per span
        (empty bytes when `digest` is False, which only copies). `streaming` True writes the
        copies past the cache whatever their size (a tier's own storage, which nobody reads
        soon); None decides by size (CACHED_COPY_MAX_BYTES)."""
        if not spans:
            return []
        work = list(spans) if digest else self._split_for_copy(spans)
        if self.native:
            results = self._run_native(work, digest, streaming)
        elif self._pool is None or len(work) == 1 or sum(s.nbytes for s in work) < PARALLEL_MIN_BYTES:
            results = self._run_group(work, digest)
        else:
            groups = self._partition(work)
            futures = [self._pool.submit(self._run_group, group, digest) for group in groups[1:]]
            first = self._run_group(groups[0], digest)
            results = first + [d for future in futures for d in future.result()]
        return results if digest else [b""] * len(spans)

    def _run_native(
        self, work: list[Span], digest: bool, streaming: bool | None, *, helpers: bool = True
    ) -> list[bytes]:
        # One prepared batch whose spans every thread claims one at a time: the native helpers
        # join within a microsecond and one that starts late simply takes fewer spans.
        total = sum(s.nbytes for s in work)
        if streaming is None:
            streaming = self._streaming(total)
        batch = CopyBatch(
            [s.src for s in work],
            [s.dst for s in work],
            [s.nbytes for s in work],
            [s.prefix for s in work],
            digest=digest,
            streaming=streaming,
        )
        if helpers and self._shared(len(work), total):
            batch.run_with_helpers()
        else:
            batch.run(shared=False)
        return batch.digests()

    @staticmethod
    def _streaming(total: int) -> bool:
        """Whether copies of `total` bytes in one batch write past the cache."""
        return total > CACHED_COPY_MAX_BYTES

    def _shared(self, spans: int, total: int) -> bool:
        """Whether a batch of `spans` spans, `total` bytes, is shared with the native helpers."""
        return bool(self._helpers) and spans > 1 and total >= HELPERS_MIN_BYTES

    def copy_mode(self, spans: int, nbytes: int) -> CopyMode:
        """How `run` copies a batch of `spans` spans, `nbytes` bytes in all (past the cache or
        through it, shared with the native helper threads or not), for a caller that runs its
        own native batch on the hasher's threads (the host tier's pool reads and fills)."""
        return CopyMode(streaming=self._streaming(nbytes), helpers=self._shared(spans, nbytes))

    def run_async(self, spans: Sequence[Span]) -> Future[list[bytes]]:
        """Hash (and copy) `spans` on the hasher's own thread and return at once, so the caller
        can read the next piece meanwhile (in one thread when the hasher has no other)."""
        if self._pool is None:
            done: Future[list[bytes]] = Future()
            done.set_result(self._run_group(list(spans), True))
            return done
        return self._pool.submit(self._run_group, list(spans), True)

    def checksum(
        self, key: uuid.UUID, data: torch.Tensor, layout: BlockLayout, *, first_layer: int = 0
    ) -> BlockChecksum | list[bytes]:
        """Checksums of a CPU buffer holding whole layers, starting at `first_layer`: a
        BlockChecksum for a whole block, else the list of layer checksums."""
        flat = tensor_bytes(data)
        count = flat.numel() // layout.layer_bytes
        base = flat.data_ptr()
        spans = [
            Span(
                src=base + i * layout.layer_bytes,
                nbytes=layout.layer_bytes,
                prefix=layer_prefix(key, first_layer + i),
            )
            for i in range(count)
        ]
        sums = self.run(spans)
        if first_layer == 0 and count == layout.layers:
            return BlockChecksum.from_layers(key, sums)
        return sums

    def _split_for_copy(self, spans: Sequence[Span]) -> list[Span]:
        # A plain copy has no per-layer hash state, so any span may be cut to spread the load.
        piece = max(self.chunk_bytes, sum(s.nbytes for s in spans) // (self.threads * 4) or 1)
        out: list[Span] = []
        for s in spans:
            for off in range(0, s.nbytes, piece):
                out.append(
                    Span(
                        src=s.src + off,
                        nbytes=min(piece, s.nbytes - off),
                        dst=None if s.dst is None else s.dst + off,
                    )
                )
        return out

    def _partition(self, spans: list[Span]) -> list[list[Span]]:
        """Fixed shares for the Python fallback's threads (one per thread at most)."""
        total = sum(s.nbytes for s in spans)
        target = total / self.threads
        groups: list[list[Span]] = [[]]
        filled = 0
        for s in spans:
            if groups[-1] and filled + s.nbytes / 2 > target * len(groups) and len(groups) < self.threads:
                groups.append([])
            groups[-1].append(s)
            filled += s.nbytes
        return groups

    def _run_group(self, spans: Sequence[Span], digest: bool) -> list[bytes]:
        if self.native:
            # On the hasher's own thread, for a caller busy with I/O meanwhile (run_async): one
            # core, so the caller keeps the other (helpers would take both).
            return self._run_native(list(spans), digest, None, helpers=False)
        chunk = self.chunk_bytes
        memmove = ctypes.memmove  # releases the GIL, so groups really run in parallel
        out = []
        for s in spans:
            if not digest:
                if s.dst is not None and s.nbytes:
                    memmove(s.dst, s.src, s.nbytes)
                continue
            h = xxhash.xxh3_128(s.prefix)
            for off in range(0, s.nbytes, chunk):
                n = min(chunk, s.nbytes - off)
                if s.dst is None:
                    h.update(address_view(s.src + off, n))
                else:
                    # Hash the fresh copy while it is cache-hot: the verified bytes are exactly
                    # the bytes the caller receives.
                    memmove(s.dst + off, s.src + off, n)
                    h.update(address_view(s.dst + off, n))
            out.append(h.digest())
        return out
