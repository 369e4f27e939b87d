"""The interface every storage tier implements: put, get a block or a layer range, contains,
delete, usage, close. Reads return futures (concurrent.futures) so layer-wise loading overlaps."""

from __future__ import annotations

import abc
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar, cast

import torch

from worker.dataplane.buffers import tensor_bytes
from worker.dataplane.checksum import BlockChecksum, Hasher
from worker.dataplane.counters import Counters
from worker.dataplane.errors import BlockCorrupt
from worker.dataplane.layout import BlockLayout

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TierUsage:
    """Capacity accounting of a tier: used = stored bytes + pending (reserved, being written)."""

    tier: str
    capacity_bytes: int
    stored_bytes: int
    pending_bytes: int
    blocks: int

    @property
    def used_bytes(self) -> int:
        return self.stored_bytes + self.pending_bytes

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)


@dataclasses.dataclass(frozen=True)
class Recount:
    """What a recount of a tier's usage counters found: how far they were from what the medium
    holds (counted minus held: positive when they counted bytes that are not there, which
    refuses writes the tier has room for), and the usage once corrected."""

    tier: str
    drift_bytes: int
    drift_blocks: int
    usage: TierUsage

    @property
    def corrected(self) -> bool:
        return bool(self.drift_bytes or self.drift_blocks)


@dataclasses.dataclass(frozen=True)
class PutResult:
    key: uuid.UUID
    tier: str
    nbytes: int
    checksum: BlockChecksum | None
    """None only for the device tier when no checksum was handed in (L1 is not verified)."""


@dataclasses.dataclass(frozen=True)
class ReadResult:
    key: uuid.UUID
    tier: str
    layers: range
    nbytes: int
    checksum: BlockChecksum | None = None
    """The block's stored checksum, just verified, on whole-block reads (None on layer reads and
    from the device tier when none was handed in); pass it on when copying the block down."""
    stored: BlockChecksum | None = None
    """The checksum in the header the tier keeps with the block (disk, remote), which the layers
    just read were verified against: on every read from such a tier, layer reads too (None from
    the memory tiers). Whoever knows what the block's checksum must be (the directory's
    registration) compares it with this one (`TieredStore.get_layers`, `expected`)."""


def resolved(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


class Tier(abc.ABC):
    """One storage medium of a node holding blocks of one layout, addressed by 16-byte keys.

    Every read below L1 is verified against the block's checksum: a mismatch is never served,
    the bad copy is removed, counted as ``<tier>.corrupt`` and raised as BlockCorrupt."""

    name: str
    writes_in_place: bool = False
    """True when `put_from` fills the tier's own storage (the bytes land once), False when it
    fills a buffer that a `put` then copies into the medium."""

    lookups_are_cheap: bool = True
    """True when `contains_many` costs little next to a read (a medium on this node), so the
    store asks such a tier which blocks it holds before reading from it; False for a medium a
    network round trip away, which the store reads at once, a miss falling through."""

    @property
    def reads_into_device(self) -> bool:
        """True when a read into GPU memory goes there straight from the medium (device copies,
        GPUDirect Storage); False when it lands in host memory first, so a loader that stages
        reads in pinned memory and copies them on a stream of its own loses nothing."""
        return False

    def __init__(
        self,
        *,
        name: str,
        layout: BlockLayout,
        counters: Counters | None = None,
        hasher: Hasher | None = None,
        io_threads: int = 1,
    ) -> None:
        self.name = name
        self.layout = layout
        self.counters = counters if counters is not None else Counters()
        self._owns_hasher = hasher is None
        self.hasher = hasher if hasher is not None else Hasher()
        self.io_threads = max(1, io_threads)
        self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"strata-{name}")
        self._closed = False

    # -- writes ---------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None) -> PutResult:
        """Store a whole block (`layout.block_bytes`, contiguous) under `key`, replacing any
        block stored under it. Either the whole block becomes readable or nothing changes:
        TierFull (no room) and TierUnavailable leave no partial block or reservation behind.
        A given `checksum` is trusted and stored (blocks moving down a tier keep theirs);
        otherwise it is computed from `data`."""

    def put_from(self, key: uuid.UUID, fill: Callable[[torch.Tensor], BlockChecksum]) -> PutResult:
        """Store a block whose bytes `fill` writes into the memory it is handed (a flat uint8
        tensor of the block's size) and whose checksum it returns, verified. If `fill` raises,
        nothing is stored and the error goes to the caller; TierFull as `put`. This default fills
        a buffer and puts it; a tier that can hand out its own storage overrides it
        (`writes_in_place`)."""
        buffer = self.layout.empty()
        checksum = fill(buffer)
        self._check_layers(checksum)
        return self.put(key, buffer, checksum=checksum)

    def put_async(
        self, key: uuid.UUID, data: torch.Tensor, *, checksum: BlockChecksum | None = None
    ) -> Future[PutResult]:
        """`put` on the tier's I/O threads; `data` must stay untouched until the future is done."""
        return self._submit(self.put, key, data, checksum=checksum)

    def put_many(
        self,
        items: Sequence[tuple[uuid.UUID, torch.Tensor]],
        *,
        checksums: Sequence[BlockChecksum | None] | None = None,
    ) -> list[Future[PutResult]]:
        """Start storing many blocks (e.g. a request's write-back); one future per block, each
        succeeding or failing on its own (TierFull for the blocks that did not fit). Tiers whose
        medium gains from batching (group commit, one parallel copy) override this."""
        checksums = list(checksums) if checksums is not None else [None] * len(items)
        if len(checksums) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(checksums)} checksums")
        return [
            self.put_async(key, data, checksum=checksum) for (key, data), checksum in zip(items, checksums, strict=True)
        ]

    # -- reads ----------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: uuid.UUID, out: torch.Tensor) -> ReadResult:
        """Read the whole block into `out` (block_bytes, contiguous, CPU or CUDA) and verify it.
        Raises BlockMissing, BlockCorrupt or TierUnavailable; `out` then holds no valid block."""

    def get_async(self, key: uuid.UUID, out: torch.Tensor) -> Future[ReadResult]:
        """`get` on the tier's I/O threads."""
        return self._submit(self.get, key, out)

    @abc.abstractmethod
    def get_layers(
        self, keys: Sequence[uuid.UUID], layers: int | range | slice, outs: Sequence[torch.Tensor]
    ) -> list[Future[ReadResult]]:
        """Start reading the same run of layers of many blocks, block i into `outs[i]` (exactly
        len(layers) * layer_bytes, contiguous). Returns one future per block, in order, each
        resolving to a ReadResult or raising BlockMissing, BlockCorrupt or TierUnavailable.
        The call itself does not wait for the medium."""

    def read_layers_into(self, keys: Sequence[uuid.UUID], layers: range, rows: torch.Tensor) -> list[Exception | None]:
        """`get_layers` into the rows of one buffer, waited for: block i's layers land in
        `rows[i]` (`rows` is [len(keys), len(layers) * layer_bytes] uint8, contiguous). Returns
        None for each block read and the error (a miss) for each block that was not. Memory
        tiers override it with one copy for the whole batch and no future per block."""
        futures = self.get_layers(keys, layers, list(rows.unbind(0)) if len(keys) else [])
        # Tiers fail a read with an Exception (a miss), never a bare BaseException.
        return cast("list[Exception | None]", [future.exception() for future in futures])

    def get_many(self, keys: Sequence[uuid.UUID], outs: Sequence[torch.Tensor]) -> list[Future[ReadResult]]:
        """Whole blocks of many keys, batched like `get_layers` (it is `get_layers` of every layer)."""
        return self.get_layers(keys, slice(None), outs)

    @abc.abstractmethod
    def checksum(self, key: uuid.UUID) -> BlockChecksum | None:
        """The checksum stored with a block, without reading its data; BlockMissing when no
        block is stored under `key`. None only from the device tier when none was handed in."""

    @abc.abstractmethod
    def keys(self) -> list[uuid.UUID]:
        """Keys of every complete block stored (a snapshot, for the reconciler and audits); a
        shared medium walks its key space without blocking other clients."""

    @abc.abstractmethod
    def stored_bytes(self, key: uuid.UUID) -> bytes | None:
        """The block's data bytes exactly as the medium holds them, unverified and with no side
        effect (a verified read would quarantine a corrupt copy), or None when none are stored.
        For audits that check the bytes apart from the tier's own read path."""

    @abc.abstractmethod
    def contains(self, key: uuid.UUID) -> bool:
        """True when a complete block is stored under `key` (not yet verified)."""

    def contains_many(self, keys: Sequence[uuid.UUID]) -> list[bool]:
        """`contains` for many keys; tiers with round trips batch them."""
        return [self.contains(key) for key in keys]

    @abc.abstractmethod
    def delete(self, key: uuid.UUID) -> bool:
        """Remove the block; True when something was removed. Readers in flight either finish
        with the old bytes intact or see a miss, never a mix."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Capacity and current use (stored + pending bytes)."""

    def recount(self) -> Recount | None:
        """Set the tier's usage counters to what the medium holds, safely beside writers in
        flight (theirs and other processes'), and say how far off they were. None when nothing
        was recounted: the tier keeps no counter that can drift (its usage is read from its own
        index at every call), or another process is recounting the same medium right now."""
        return None

    def ping(self) -> None:  # noqa: B027 - a medium on this node always answers
        """Raise TierUnavailable unless the medium answers now (a store checks each tier it
        opens, so one that cannot serve fails loudly at start-up). Local media have nothing to
        ask."""

    def sync(self) -> None:  # noqa: B027 - tiers with nothing to make durable keep this
        """Make every put that has returned survive a crash of the machine, for a tier whose puts
        return before that (the disk tier syncs its directories in the background). Memory
        tiers have nothing to do; a remote store is as durable as it is configured to be."""

    def drain_deletes(self) -> None:  # noqa: B027 - tiers that delete at once keep this
        """Return once the bytes of every block deleted so far are freed, for a tier that frees
        them after `delete` returns (the disk tier unlinks its files in the background)."""

    def close(self) -> None:
        """Wait for in-flight work and release the tier's resources; the bytes stay stored."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._owns_hasher:
            self.hasher.close()

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for implementations ------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> Future[T]:
        return self._executor.submit(fn, *args, **kwargs)

    def _read_async(
        self,
        read: Callable[[list[uuid.UUID], range, list[torch.Tensor]], Sequence[ReadResult | BaseException]],
        keys: Sequence[uuid.UUID],
        layers: int | range | slice,
        outs: Sequence[torch.Tensor],
    ) -> list[Future[ReadResult]]:
        """`get_layers` for tiers that read a whole batch in one call: `read` returns one
        ReadResult or error per key; it runs on the tier's I/O thread, one future per block."""
        selected = self.layout.layer_range(layers)
        dsts = self._layer_outs(selected, keys, outs)
        futures: list[Future[ReadResult]] = [Future() for _ in keys]

        def run() -> None:
            try:
                results: Sequence[ReadResult | BaseException] = read(list(keys), selected, dsts)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting future
                results = [exc] * len(keys)
            for future, result in zip(futures, results, strict=True):
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

        if keys:
            self._submit(run)
        return futures

    def _block_bytes(self, data: torch.Tensor) -> torch.Tensor:
        flat = tensor_bytes(data)
        if flat.numel() != self.layout.block_bytes:
            raise ValueError(f"a block of this layout is {self.layout.block_bytes} bytes, got {flat.numel()}")
        return flat

    def _check_layers(self, checksum: BlockChecksum) -> None:
        """ValueError unless a given block checksum has one layer checksum per layer."""
        if len(checksum.layers) != self.layout.layers:
            raise ValueError(f"checksum has {len(checksum.layers)} layers, the layout {self.layout.layers}")

    def _layer_outs(self, layers: range, keys: Sequence[uuid.UUID], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} destination buffers")
        want = len(layers) * self.layout.layer_bytes
        flats = [tensor_bytes(out) for out in outs]
        for flat in flats:
            if flat.numel() != want:
                raise ValueError(f"{len(layers)} layers are {want} bytes, a destination holds {flat.numel()}")
        return flats

    def _corrupt(self, key: uuid.UUID, reason: str) -> BlockCorrupt:
        """Count and quarantine (remove) a copy that failed verification; returns the error."""
        self.counters.add(f"{self.name}.corrupt")
        try:
            if self.delete(key):
                self.counters.add(f"{self.name}.quarantined")
        except Exception:  # the read already failed; removal is best effort
            self.counters.add(f"{self.name}.quarantine_failed")
        return BlockCorrupt(key, tier=self.name, reason=reason)

    def _verify(self, key: uuid.UUID, layers: range, got: Sequence[bytes], want: Sequence[bytes]) -> None:
        for layer, g, w in zip(layers, got, want, strict=True):
            if g != w:
                raise self._corrupt(key, f"layer {layer} checksum mismatch")
