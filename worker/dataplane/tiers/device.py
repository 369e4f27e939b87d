"""L1 device tier: a preallocated torch pool of fixed-size pages (GPU memory, CPU without a GPU).

One page per block and an O(1) free-list allocator: no external fragmentation and nothing is
reserved per request. L1 is the compute tier: its reads are not checksum-verified, but a checksum
handed in at put is kept, so a block moving down does not need hashing again."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from worker.dataplane.checksum import BlockChecksum, Hasher
from worker.dataplane.counters import Counters
from worker.dataplane.errors import BlockMissing, TierFull
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.base import PutResult, ReadResult, Tier, TierUsage, failed, resolved


@dataclasses.dataclass
class _Page:
    index: int
    checksum: BlockChecksum | None
    readers: int = 0
    deleted: bool = False


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(Tier):
    """Fixed-size pages in one preallocated tensor; `capacity_bytes // block_bytes` pages."""

    @property
    def reads_into_device(self) -> bool:
        return True

    def __init__(
        self,
        *,
        layout: BlockLayout,
        capacity_bytes: int,
        device: torch.device | str | None = None,
        counters: Counters | None = None,
        hasher: Hasher | None = None,
        name: str = "device",
    ) -> None:
        super().__init__(name=name, layout=layout, counters=counters, hasher=hasher, io_threads=1)
        self.device = torch.device(device) if device is not None else default_device()
        self.pages = capacity_bytes // layout.block_bytes
        # Zeroed, not just reserved: on the CPU that makes every page resident now, as GPU
        # memory is, so no put pays for first-touch page faults.
        self._pool = torch.zeros((self.pages, layout.block_bytes), dtype=torch.uint8, device=self.device)
        self._free = list(range(self.pages - 1, -1, -1))  # a stack: pop/append are O(1)
        self._index: dict[uuid.UUID, _Page] = {}
        self._writing = 0
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # A page is only reused once no reader holds it, so a delete racing a read never tears it.
    def _acquire(self, key: uuid.UUID) -> _Page:
        (page,) = self._acquire_many([key])
        if page is None:
            raise BlockMissing(key, tier=self.name)
        return page

    def _acquire_many(self, keys: Sequence[uuid.UUID]) -> list[_Page | None]:
        """Hold the page of every key (None where none is stored), under one lock."""
        held: list[_Page | None] = []
        with self._lock:
            for key in keys:
                page = self._index.get(key)
                if page is not None:
                    page.readers += 1
                held.append(page)
        return held

    def _release(self, *pages: _Page) -> None:
        with self._lock:
            for page in pages:
                page.readers -= 1
                if page.deleted and page.readers == 0:
                    self._free.append(page.index)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def put(self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None) -> PutResult:
        src = self._block_bytes(data)
        with self._lock:
            if not self._free:
                self.counters.add(f"{self.name}.full")
                raise TierFull(self.name, needed=self.layout.block_bytes, free=0)
            index = self._free.pop()
            self._writing += 1
        try:
            self._copy(self._pool[index], src)
        except BaseException:
            with self._lock:
                self._writing -= 1
                self._free.append(index)
            raise
        with self._lock:
            self._writing -= 1
            old = self._index.get(key)
            self._index[key] = _Page(index=index, checksum=checksum)
            if old is not None:
                old.deleted = True
                if old.readers == 0:
                    self._free.append(old.index)
        self.counters.add(f"{self.name}.puts")
        return PutResult(key=key, tier=self.name, nbytes=self.layout.block_bytes, checksum=checksum)

    def put_many(
        self,
        items: Sequence[tuple[uuid.UUID, torch.Tensor]],
        *,
        checksums: Sequence[BlockChecksum | None] | None = None,
    ) -> list[Future[PutResult]]:
        """Memory-speed copies, done in the caller's thread (a thread hop would cost more)."""
        checksums = list(checksums) if checksums is not None else [None] * len(items)
        if len(checksums) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(checksums)} checksums")
        futures: list[Future[PutResult]] = []
        for (key, data), checksum in zip(items, checksums, strict=True):
            future: Future[PutResult] = Future()
            try:
                future.set_result(self.put(key, data, checksum=checksum))
            except Exception as exc:
                future.set_exception(exc)
            futures.append(future)
        return futures

    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        dst = self._block_bytes(out)
        page = self._acquire(key)
        try:
            self._copy(dst, self._pool[page.index])
        finally:
            self._release(page)
        self.counters.add(f"{self.name}.hits")
        return ReadResult(
            key=key,
            tier=self.name,
            layers=range(self.layout.layers),
            nbytes=dst.numel(),
            checksum=page.checksum,
        )

    def get_async(self, key: uuid.UUID, out: torch.Tensor) -> Future[ReadResult]:
        # A memory-speed copy: handing it to a thread would cost more than doing it.
        try:
            return resolved(self.get(key, out))
        except Exception as exc:  # delivered through the future like every other tier
            return failed(exc)

    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        selected = self.layout.layer_range(layers)
        dsts = self._layer_outs(selected, keys, outs)
        offset, nbytes = self.layout.span(selected)
        futures: list[Future[ReadResult]] = [Future() for _ in keys]
        held: list[tuple[int, _Page]] = []
        for i, (key, page) in enumerate(zip(keys, self._acquire_many(keys), strict=True)):
            if page is None:
                futures[i].set_exception(BlockMissing(key, tier=self.name))
            else:
                held.append((i, page))
        if self._stream is None:
            try:
                self._gather(held, dsts, offset, nbytes)
            finally:
                self._finish_layers(keys, held, futures, selected, nbytes)
            return futures
        # CUDA: queue every copy on the tier's stream and resolve the futures from a thread
        # once the stream's event fires, so the caller is never blocked on the copies.
        with torch.cuda.stream(self._stream):
            self._gather(held, dsts, offset, nbytes)
            done = torch.cuda.Event()
            done.record(self._stream)

        def wait() -> None:
            try:
                done.synchronize()
            finally:
                self._finish_layers(keys, held, futures, selected, nbytes)

        self._submit(wait)
        return futures

    def read_layers_into(self, keys: Sequence[uuid.UUID], layers: range, rows: torch.Tensor) -> list[Exception | None]:
        """One gather of `layers` of every stored block into its row (nothing per block but the
        index lookup); on CUDA the copy runs on the tier's stream and is waited for."""
        offset, nbytes = self.layout.span(layers)
        if rows.shape != (len(keys), nbytes) or rows.dtype != torch.uint8 or not rows.is_contiguous():
            raise ValueError(
                f"{len(keys)} blocks of {len(layers)} layers need a contiguous uint8 buffer of "
                f"[{len(keys)}, {nbytes}], got {rows.dtype} {list(rows.shape)}"
            )
        errors: list[Exception | None] = [None] * len(keys)
        held: list[tuple[int, _Page]] = []
        for i, (key, page) in enumerate(zip(keys, self._acquire_many(keys), strict=True)):
            if page is None:
                errors[i] = BlockMissing(key, tier=self.name)
            else:
                held.append((i, page))
        try:
            if held:
                source = self._pool[:, offset : offset + nbytes]
                with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                    pages = torch.tensor([page.index for _, page in held], dtype=torch.long)
                    if len(held) == len(keys):  # every row: straight into the buffer
                        target = rows if rows.device == source.device else None
                        gathered = torch.index_select(source, 0, pages.to(source.device), out=target)
                        if target is None:
                            rows.copy_(gathered, non_blocking=self._stream is not None)
                    else:
                        places = torch.tensor([i for i, _ in held], dtype=torch.long, device=rows.device)
                        picked = torch.index_select(source, 0, pages.to(source.device))
                        rows.index_copy_(0, places, picked.to(rows.device))
                if self._stream is not None:
                    self._stream.synchronize()
        finally:
            self._release(*(page for _, page in held))
        if held:
            self.counters.add(f"{self.name}.hits", len(held))
        return errors

    def _gather(self, held: list[tuple[int, _Page]], dsts: list[torch.Tensor], offset: int, nbytes: int) -> None:
        """Copy bytes [offset, offset + nbytes) of every held page into its destination: one
        gather (`index_select`) per run of destinations that lie back to back in one buffer (a
        loader's per-layer buffer takes the whole batch in one call), a copy each otherwise."""
        blocking = self._stream is None
        source = self._pool[:, offset : offset + nbytes]
        for run in _adjacent_runs([dsts[i] for i, _ in held], nbytes):
            first, count = run
            if count == 1:
                dsts[held[first][0]].copy_(source[held[first][1].index], non_blocking=not blocking)
                continue
            pages = torch.tensor([page.index for _, page in held[first : first + count]], dtype=torch.long)
            out = dsts[held[first][0]]
            target = torch.empty(0, dtype=torch.uint8, device=out.device).set_(
                out.untyped_storage(), out.storage_offset(), (count, nbytes), (nbytes, 1)
            )
            if target.device == source.device:
                torch.index_select(source, 0, pages.to(source.device, non_blocking=True), out=target)
            else:  # a CPU pool into GPU buffers, or the reverse: gather where the pool is, then one copy
                target.copy_(torch.index_select(source, 0, pages.to(source.device)), non_blocking=not blocking)

    def _finish_layers(
        self,
        keys: Sequence[uuid.UUID],
        held: list[tuple[int, _Page]],
        futures: list[Future[ReadResult]],
        selected: range,
        nbytes: int,
    ) -> None:
        self._release(*(page for _, page in held))
        if held:
            self.counters.add(f"{self.name}.hits", len(held))
        for i, _ in held:
            futures[i].set_result(ReadResult(key=keys[i], tier=self.name, layers=selected, nbytes=nbytes))

    def page(self, key: uuid.UUID) -> torch.Tensor:
        """The stored bytes of a block, zero-copy (for the engine's attention). Valid until the
        block is deleted or replaced; do not hold it across either."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise BlockMissing(key, tier=self.name)
            return self._pool[entry.index]

    def checksum(self, key: uuid.UUID) -> BlockChecksum | None:
        """The checksum handed in at put, if any."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise BlockMissing(key, tier=self.name)
            return entry.checksum

    def keys(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self._index)

    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            return bytes(self._pool[entry.index].cpu().numpy())

    def contains(self, key: uuid.UUID) -> bool:
        with self._lock:
            return key in self._index

    def contains_many(self, keys: Sequence[uuid.UUID]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def delete(self, key: uuid.UUID) -> bool:
        with self._lock:
            page = self._index.pop(key, None)
            if page is None:
                return False
            page.deleted = True
            if page.readers == 0:
                self._free.append(page.index)
            return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                tier=self.name,
                capacity_bytes=self.pages * self.layout.block_bytes,
                stored_bytes=len(self._index) * self.layout.block_bytes,
                pending_bytes=self._writing * self.layout.block_bytes,
                blocks=len(self._index),
            )

    def close(self) -> None:
        super().close()
        self._index.clear()
        self._free.clear()
        # Drop the pool so GPU memory returns to the caching allocator at once.
        self._pool = torch.empty(0, dtype=torch.uint8, device=self.device)


def _adjacent_runs(dsts: Sequence[torch.Tensor], nbytes: int) -> list[tuple[int, int]]:
    """(first, count) of each run of `dsts` (nbytes each) where every one starts where the one
    before it ends, in the same storage and on the same device."""
    runs: list[tuple[int, int]] = []
    previous: torch.Tensor | None = None
    for i, dst in enumerate(dsts):
        if (
            previous is not None
            and dst.device == previous.device
            and dst.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr()
            and dst.storage_offset() == previous.storage_offset() + nbytes
        ):
            first, count = runs[-1]
            runs[-1] = (first, count + 1)
        else:
            runs.append((i, 1))
        previous = dst
    return runs
