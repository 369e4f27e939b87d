"""Block checksums (xxh3-128 per layer, chained into one per block) and the fused copy+verify engine.

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

import torch
import xxhash

from worker.dataplane.buffers import address_view, tensor_bytes
from worker.dataplane.layout import BlockLayout
from worker.dataplane.native import CopyBatch
from worker.dataplane.native import available as native_available
from worker.dataplane.native import copy_hash as native_copy_hash

CHECKSUM_BYTES = 16

CHUNK_BYTES = 512 * 1024
"""Copy-then-hash granule of the Python fallback (the fused routine in `native` uses its own,
hashing each 64 KiB of the source and copying it from cache with streaming stores). Measured on the 2-core dev box (32 MiB blocks, 2 threads): hashing
each 256-512 KiB chunk right after copying it, while it is still in cache, runs at ~0.85x a
2-thread torch memcpy; 64 KiB chunks drown in per-call overhead (0.57x), 2 MiB chunks fall out
of cache (0.76x), and copying a whole block before hashing it runs at ~0.65x."""

PARALLEL_MIN_BYTES = 8 * 1024 * 1024
"""Below this, handing work to another Python thread costs more than it saves: waking a pool
thread and trading the GIL costs 50-100 us, while 2 MiB copies and hashes in ~200 us on one
core (measured on the 2-core dev box: one thread beat two for 2 MiB, two beat one for 32 MiB)."""


def layer_prefix(key: uuid.UUID, layer: int) -> bytes:
    return key.bytes + layer.to_bytes(4, "little")


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
            raise ValueError(
                f"expected {CHECKSUM_BYTES * (layers + 1)} bytes of checksums, got {len(raw)}"
            )
        sums = tuple(
            raw[i : i + CHECKSUM_BYTES] for i in range(CHECKSUM_BYTES, len(raw), CHECKSUM_BYTES)
        )
        return cls(block=raw[:CHECKSUM_BYTES], layers=sums)

    def pack(self) -> bytes:
        return self.block + b"".join(self.layers)

    @property
    def hex(self) -> str:
        return self.block.hex()

    def consistent(self, key: uuid.UUID) -> bool:
        """True when the block checksum matches the layer checksums under `key`."""
        return len(self.block) == CHECKSUM_BYTES and self.block == block_checksum(key, self.layers)


@dataclasses.dataclass(frozen=True)
class Span:
    """One layer's worth of work for the engine: hash `nbytes` at `src` (after `prefix`), and copy
    them to `dst` when it is set, chunk by chunk, so the digest covers exactly the bytes copied
    (callers reading memory another process may change check a generation around the call).
    Addresses are raw CPU pointers kept alive by the caller."""

    src: int
    nbytes: int
    prefix: bytes = b""
    dst: int | None = None


class ChecksumEngine:
    """Copies and hashes spans of memory on a few threads, chunk by chunk, so a verified copy
    runs at memcpy speed. The caller's thread does a share of the work itself.

    With the fused routine in `native`, every thread works through one prepared batch in one call
    without the interpreter lock, claiming a span at a time, so a busy Python thread elsewhere in
    the process cannot slow it and a thread that wakes late takes less work. `native` False (or
    the routine not built) splits the spans into fixed shares and hashes in Python, giving up the
    lock per chunk."""

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
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="strata-copy")
            if threads > 1
            else None
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> ChecksumEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, spans: Sequence[Span], *, digest: bool = True) -> list[bytes]:
        """Copy (where `dst` is set) and hash every span; returns one 16-byte digest per span
        (empty bytes when `digest` is False, which only copies)."""
        if not spans:
            return []
        work = list(spans) if digest else self._split_for_copy(spans)
        if self._pool is None or len(work) == 1 or sum(s.nbytes for s in work) < PARALLEL_MIN_BYTES:
            results = self._run_group(work, digest)
        elif self.native:
            results = self._run_shared(work, digest)
        else:
            groups = self._partition(work)
            futures = [self._pool.submit(self._run_group, group, digest) for group in groups[1:]]
            first = self._run_group(groups[0], digest)
            results = first + [d for future in futures for d in future.result()]
        return results if digest else [b""] * len(spans)

    def _run_shared(self, work: list[Span], digest: bool) -> list[bytes]:
        # Every thread works through one prepared batch, claiming a span at a time: a pool
        # thread that wakes late takes fewer spans instead of leaving this one waiting for a
        # fixed half (on this 2-core box that wait was a tenth of a 32 MiB block's read).
        batch = CopyBatch([s.src for s in work], [s.dst for s in work], [s.nbytes for s in work],
                          [s.prefix for s in work], digest=digest)
        assert self._pool is not None
        helpers = [self._pool.submit(batch.run) for _ in range(self.threads - 1)]
        try:
            batch.run()
        finally:
            # The spans' memory belongs to the caller: no helper may still be copying when this
            # returns, even when this thread's share failed.
            for helper in helpers:
                helper.result()
        return batch.digests()

    def run_async(self, spans: Sequence[Span]) -> Future[list[bytes]]:
        """Hash (and copy) `spans` on the engine's own thread and return at once, so the caller
        can read the next piece meanwhile (in one thread when the engine has no other)."""
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
            if (
                groups[-1]
                and filled + s.nbytes / 2 > target * len(groups)
                and len(groups) < self.threads
            ):
                groups.append([])
            groups[-1].append(s)
            filled += s.nbytes
        return groups

    def _run_group(self, spans: Sequence[Span], digest: bool) -> list[bytes]:
        if self.native:
            digests = native_copy_hash(
                [s.src for s in spans],
                [s.dst for s in spans],
                [s.nbytes for s in spans],
                [s.prefix for s in spans],
                digest=digest,
            )
            return digests if digest else []
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
