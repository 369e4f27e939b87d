"""TieredStore: put, get, locate and delete KV blocks across the tiers of one node, plus its factory.

The store holds no policy: which tier a block goes to is the caller's choice (the control plane
plans movements). Reads look in the tiers fastest first; a miss, a corrupt copy or an
unavailable tier in one tier falls through to the next that may hold the block, and only when
every candidate fails does the caller see BlockMissing (and recompute).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import cast

import torch

from worker.dataplane.checksum import BlockChecksum, Hasher
from worker.dataplane.config import ConfigError, NodeConfig
from worker.dataplane.counters import Counters
from worker.dataplane.directory import check_checksum
from worker.dataplane.errors import MISSES, BlockMissing, BlockUnregistered, TierUnavailable
from worker.dataplane.hashing import model_key
from worker.dataplane.layout import BlockLayout, ModelProfile, block_layout
from worker.dataplane.network import ConnectionOptions
from worker.dataplane.tier_names import DEVICE, DISK, HOST, REMOTE, TIER_ORDER
from worker.dataplane.tiers.base import (
    PutResult,
    ReadResult,
    Tier,
    TierUsage,
    failed,
)
from worker.dataplane.tiers.mediums import (
    DevicePages,
    FileDirectory,
    Medium,
    SharedMemoryPool,
    remote_medium,
)
from worker.dataplane.tiers.remote import RedisClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GetResult:
    """A whole block read by the store: which tier served it, and the buffer holding it."""

    key: uuid.UUID
    tier: str
    data: torch.Tensor
    checksum: BlockChecksum | None


class TieredStore:
    """The tiers of one node for one block layout, fastest first."""

    def __init__(
        self,
        *,
        layout: BlockLayout,
        tiers: Sequence[Tier],
        counters: Counters | None = None,
        hasher: Hasher | None = None,
    ) -> None:
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        for tier in tiers:
            if tier.layout != layout:
                raise ValueError(f"tier {tier.name} holds blocks of another layout")
        self.layout = layout
        self.counters = counters if counters is not None else Counters()
        self._tiers: dict[str, Tier] = {tier.name: tier for tier in tiers}
        self._hasher = hasher

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    def tier(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise KeyError(f"this store has no tier {name!r}; it has {', '.join(self._tiers)}") from None

    def _order(self, tiers: Sequence[str] | None) -> list[Tier]:
        return [self.tier(name) for name in (tiers if tiers is not None else self.names)]

    # -- writes ---------------------------------------------------------------------------
    def put(
        self,
        key: uuid.UUID,
        data: torch.Tensor,
        *,
        tier: str,
        checksum: BlockChecksum | None = None,
    ) -> PutResult:
        """Store a whole block in one tier (see `Tier.put`)."""
        return self.tier(tier).put(key, data, checksum=checksum)

    def put_async(
        self,
        key: uuid.UUID,
        data: torch.Tensor,
        *,
        tier: str,
        checksum: BlockChecksum | None = None,
    ) -> Future[PutResult]:
        return self.tier(tier).put_async(key, data, checksum=checksum)

    def copy(self, key: uuid.UUID, *, source: str, target: str, buffer: torch.Tensor | None = None) -> PutResult:
        """Copy a block between tiers: a verified read from `source`, then a put into `target`
        carrying the checksum just verified (no second hash). The source keeps its copy."""
        data = buffer if buffer is not None else self.layout.empty()
        read = self.tier(source).get(key, data)
        return self.tier(target).put(key, data, checksum=read.checksum)

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: uuid.UUID, *, out: torch.Tensor | None = None, tiers: Sequence[str] | None = None) -> GetResult:
        """Read a whole block from the fastest tier that serves it intact; BlockMissing (with
        each tier's error in `causes`) when none does."""
        data = out if out is not None else self.layout.empty()
        causes: list[Exception] = []
        for tier in self._order(tiers):
            try:
                read = tier.get(key, data)
            except MISSES as exc:
                causes.append(exc)
                continue
            self.counters.add(f"store.hits.{tier.name}")
            return GetResult(key=key, tier=tier.name, data=data, checksum=read.checksum)
        self.counters.add("store.misses")
        raise BlockMissing(key, causes=tuple(causes))

    def get_layers(
        self,
        keys: Sequence[uuid.UUID],
        *,
        layers: int | range | slice,
        outs: Sequence[torch.Tensor],
        tiers: Sequence[str] | None = None,
        expected: Sequence[str] | None = None,
    ) -> list[Future[ReadResult]]:
        """Read the same run of layers of many blocks, block i into `outs[i]`; one future per
        block, resolving to the ReadResult of the tier that served it, or raising BlockMissing.

        Blocks are grouped by the fastest local tier holding them and read in one batched call
        per tier; the remote tier is asked (batched) for the rest. A block that fails in one tier
        is retried alone in the next tier that may hold it. This is the building block of
        layer-wise loading: request layer 0 of every hit block, then layer 1, and so on.

        `expected` holds, per block, the checksum (hex) the directory registered for its copy in
        the shared remote tier. Every node can write to that tier, so a copy there that passes its
        own header's checks proves nothing by itself: with `expected`, block i is served from it
        only when the checksum in the copy's header is `expected[i]` (the layers read are verified
        against that header, so its block checksum vouches for them); any other copy is refused as
        a miss (BlockUnregistered among the causes, counted ``remote.unverified``) and left for
        the quarantine of the failed load to drop (`drop_unregistered`). An empty entry (nothing
        registered there for the block) keeps the remote tier out of that block's read
        altogether. Without `expected` (no directory to ask) the header's own checks are all
        there is."""
        selected = self.layout.layer_range(layers)
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} destination buffers")
        if expected is not None and len(expected) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(expected)} expected checksums")
        order = self._order(tiers)
        local = [tier for tier in order if tier.lookups_are_cheap]
        remote = [tier for tier in order if not tier.lookups_are_cheap]
        results: list[Future[ReadResult]] = [None] * len(keys)  # type: ignore[list-item]  # all set below
        groups: dict[str, list[int]] = {}
        candidates: list[list[Tier]] = []
        held = [tier.contains_many(keys) for tier in local]  # one pass per tier, not one call per key
        for i, key in enumerate(keys):
            found = [tier for tier, has in zip(local, held, strict=True) if has[i]] + remote
            if expected is not None and not expected[i]:
                found = [tier for tier in found if tier.name != REMOTE]
            candidates.append(found)
            if not found:
                self.counters.add("store.misses")
                results[i] = failed(BlockMissing(key))
            else:
                groups.setdefault(found[0].name, []).append(i)
        for name, members in groups.items():
            futures = self._tiers[name].get_layers([keys[i] for i in members], selected, [outs[i] for i in members])
            served = 0
            for i, future in zip(members, futures, strict=True):
                registered = expected[i] if expected is not None else ""
                if future.done() and future.exception() is None and not (registered and name == REMOTE):
                    # Served already (a memory tier): the tier's own future is the answer.
                    results[i] = future
                    served += 1
                    continue
                results[i] = Future()
                self._chain(future, results[i], keys[i], selected, outs[i], candidates[i], 0, [], registered)
            if served:
                self.counters.add(f"store.hits.{name}", served)
        return results

    def read_layers(
        self,
        keys: Sequence[uuid.UUID],
        *,
        layers: int | range | slice,
        out: torch.Tensor,
        tiers: Sequence[str] | None = None,
        expected: Sequence[str] | None = None,
    ) -> list[Exception | None]:
        """`get_layers` waited for, into one buffer: block i's layers land in row i of `out`
        (contiguous uint8, len(keys) x len(layers) * layer_bytes, or that many bytes). Returns
        None for each block served and BlockMissing (each tier's error in `causes`) for each
        block no tier served. When one tier is the fastest holder of every block, it reads them
        all in one call (`Tier.read_layers_into`, a single gather in memory); a block it fails
        falls through to the slower tiers as in `get_layers`, which also says what `expected`
        does (a remote tier that is the fastest holder is then read through it)."""
        selected = self.layout.layer_range(layers)
        nbytes = len(selected) * self.layout.layer_bytes
        if not out.is_contiguous() or out.dtype != torch.uint8 or out.numel() != len(keys) * nbytes:
            raise ValueError(
                f"{len(keys)} blocks of {len(selected)} layers need a contiguous uint8 buffer of "
                f"{len(keys) * nbytes} bytes, got {out.dtype} {list(out.shape)}"
            )
        rows = out.view(len(keys), nbytes)
        order = self._order(tiers)
        local = [tier for tier in order if tier.lookups_are_cheap]
        checked = expected is not None and bool(local) and local[0].name == REMOTE
        holds = local[0].contains_many(keys) if local and keys and not checked else []
        if not holds or not all(holds):
            futures = self.get_layers(
                keys, layers=selected, outs=list(rows.unbind(0)) if keys else [], tiers=tiers, expected=expected
            )
            # Tiers fail a read with an Exception (a miss), never a bare BaseException.
            return cast("list[Exception | None]", [future.exception() for future in futures])
        first = local[0]
        errors = first.read_layers_into(keys, selected, rows)
        failed_at = [i for i, error in enumerate(errors) if error is not None]
        if len(failed_at) < len(keys):
            self.counters.add(f"store.hits.{first.name}", len(keys) - len(failed_at))
        retry = [i for i in failed_at if isinstance(errors[i], MISSES)]
        if retry:
            self.counters.add("store.fallbacks", len(retry))
            later = [tier.name for tier in order if tier is not first]
            futures = self.get_layers(
                [keys[i] for i in retry],
                layers=selected,
                outs=[rows[i] for i in retry],
                tiers=later,
                expected=None if expected is None else [expected[i] for i in retry],
            )
            for i, future in zip(retry, futures, strict=True):
                error = future.exception()
                if error is not None:
                    later_causes = error.causes if isinstance(error, BlockMissing) else ()
                    causes = (errors[i], *(later_causes or (error,)))
                    errors[i] = BlockMissing(keys[i], causes=tuple(c for c in causes if c is not None))
                else:
                    errors[i] = None
        return errors

    def _chain(
        self,
        attempt: Future[ReadResult],
        result: Future[ReadResult],
        key: uuid.UUID,
        layers: range,
        out: torch.Tensor,
        candidates: list[Tier],
        index: int,
        causes: list[Exception],
        registered: str = "",
    ) -> None:
        def done(future: Future[ReadResult]) -> None:
            error = future.exception()
            if error is None:
                tier = candidates[index]
                if registered and tier.name == REMOTE:
                    error = self._unregistered(tier, future.result(), registered)
                if error is None:
                    self.counters.add(f"store.hits.{tier.name}")
                    result.set_result(future.result())
                    return
            if not isinstance(error, MISSES):
                result.set_exception(error)
                return
            causes.append(error)
            if index + 1 >= len(candidates):
                self.counters.add("store.misses")
                result.set_exception(BlockMissing(key, causes=tuple(causes)))
                return
            self.counters.add("store.fallbacks")
            following = candidates[index + 1]
            try:
                retry = following.get_layers([key], layers, [out])[0]
            except Exception as exc:  # a tier that cannot even start the read
                retry = failed(exc)
            self._chain(retry, result, key, layers, out, candidates, index + 1, causes, registered)

        if attempt.done():  # a memory tier's reads are done on return: no callback to schedule
            done(attempt)
        else:
            attempt.add_done_callback(done)

    def _unregistered(self, tier: Tier, read: ReadResult, registered: str) -> Exception | None:
        """None when the copy `read` came from carries the `registered` checksum; else
        BlockUnregistered, counted (``<tier>.unverified``, one per read refused). The copy stays
        until the failed load is quarantined (`OffloadManager.quarantine`), so that the reads of
        the block's other layers in flight meanwhile fail the same way, not as a plain miss. A
        malformed `registered` is the caller's bug: ValueError."""
        stored = read.stored.hex if read.stored is not None else ""
        if stored == registered:
            return None
        try:
            check_checksum(registered, what=f"expected checksum of block {read.key}")
        except ValueError as exc:
            return exc
        self.counters.add(f"{tier.name}.unverified")
        return BlockUnregistered(read.key, tier=tier.name, stored=stored, registered=registered)

    # -- lookup and removal ---------------------------------------------------------------
    def locate(
        self, keys: Sequence[uuid.UUID], *, tiers: Sequence[str] | None = None
    ) -> dict[uuid.UUID, tuple[str, ...]]:
        """Which tiers hold each block (batched per tier; an unavailable tier holds nothing)."""
        found: dict[uuid.UUID, list[str]] = {key: [] for key in keys}
        for tier in self._order(tiers):
            try:
                present = tier.contains_many(list(keys))
            except TierUnavailable:
                continue
            for key, here in zip(keys, present, strict=True):
                if here:
                    found[key].append(tier.name)
        return {key: tuple(names) for key, names in found.items()}

    def contains(self, key: uuid.UUID) -> tuple[str, ...]:
        return self.locate([key])[key]

    def drop_unregistered(self, error: BlockUnregistered) -> bool:
        """Remove the copy a read refused (`error`) if its tier still holds those bytes (the copy
        still carries the checksum the read found): a copy written over it since, registered or
        not, is left for its own readers to judge. True when removed; counted
        (``<tier>.quarantined``)."""
        tier = self.tier(error.tier)
        try:
            held = tier.checksum(error.key)
        except MISSES:
            return False  # gone already, or damaged (and dropped) now
        if held is None or held.hex != error.stored:
            return False
        if not tier.delete(error.key):
            return False
        self.counters.add(f"{tier.name}.quarantined")
        return True

    def delete(self, key: uuid.UUID, *, tier: str | None = None) -> tuple[str, ...]:
        """Remove a block from one tier or from all; returns the tiers it was removed from."""
        removed = []
        for each in self._order([tier] if tier is not None else None):
            if each.delete(key):
                removed.append(each.name)
        return tuple(removed)

    # -- accounting -----------------------------------------------------------------------
    def usage(self) -> dict[str, TierUsage]:
        """Capacity accounting per tier (used = stored + pending bytes)."""
        return {name: tier.usage() for name, tier in self._tiers.items()}

    def stats(self) -> dict[str, int]:
        """Every counter as a plain int: per-tier events (``host.corrupt``, ``remote.unavailable``,
        ``disk.hits`` ...) and the store's (``store.hits.<tier>``, ``store.misses``)."""
        merged = self.counters.snapshot()
        for tier in self._tiers.values():
            if tier.counters is not self.counters:
                for name, value in tier.counters.snapshot().items():
                    merged[name] = merged.get(name, 0) + value
        return dict(sorted(merged.items()))

    def close(self) -> None:
        for tier in self._tiers.values():
            tier.close()
        if self._hasher is not None:
            self._hasher.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class StoreSetting:
    """What the medium of a level is chosen from: the node options, the process environment
    (REDIS_URL), the store's model and device, and a ready Redis client if one is given."""

    config: NodeConfig
    profile: ModelProfile
    environ: Mapping[str, str]
    remote_client: RedisClient | None
    device: torch.device | str | None


def _device_medium(setting: StoreSetting) -> Medium:
    return DevicePages(capacity_bytes=setting.config.device_bytes, device=setting.device)


def _host_medium(setting: StoreSetting) -> Medium:
    """The host pool is `<host_pool_name>-<model key>` in /dev/shm, shared by every process of
    the node that builds the same store."""
    config = setting.config
    return SharedMemoryPool(
        capacity_bytes=config.host_bytes,
        pool_name=f"{config.node_host_pool_name}-{model_key(setting.profile).hex[:12]}",
    )


def _disk_medium(setting: StoreSetting) -> Medium:
    config = setting.config
    return FileDirectory(
        capacity_bytes=config.disk_bytes,
        path=config.node_disk_path,
        io_threads=config.disk_io_threads,
        direct_io=config.disk_direct_io,
        reuse_deleted_s=config.disk_reuse_seconds,
    )


def _remote_medium(setting: StoreSetting) -> Medium:
    """Redis/Valkey or a shared filesystem mount, by the URL (`remote_url`, else REDIS_URL)."""
    config = setting.config
    url = config.remote_url or setting.environ.get("REDIS_URL", "")
    if not url and setting.remote_client is None:
        raise ConfigError("remote_url: the remote tier is enabled but neither STRATA_REMOTE_URL nor REDIS_URL is set")
    return remote_medium(
        url,
        capacity_bytes=config.remote_bytes,
        prefix=config.remote_prefix,
        io_threads=config.io_threads,
        cluster=config.remote_cluster,
        timeout_s=config.remote_timeout_seconds,
        client=setting.remote_client,
        connection=ConnectionOptions.from_config(config),
    )


LEVEL_MEDIUMS: Mapping[str, Callable[[StoreSetting], Medium]] = {
    DEVICE: _device_medium,
    HOST: _host_medium,
    DISK: _disk_medium,
    REMOTE: _remote_medium,
}
"""The medium of each tier level (`tier_names.TIER_ORDER`), from the store's setting."""


def build_store(
    config: NodeConfig,
    *,
    profile: ModelProfile,
    environ: Mapping[str, str] | None = None,
    remote_client: RedisClient | None = None,
    device: torch.device | str | None = None,
) -> TieredStore:
    """The node's store for one model, from the node options: the tiers in `config.tiers`,
    each on the medium `LEVEL_MEDIUMS` gives its level, sized by `*_bytes`. Fails loudly: a
    tier that cannot start (no remote URL, Redis not answering, /dev/shm too small) raises, it
    is never dropped."""
    setting = StoreSetting(
        config=config,
        profile=profile,
        environ=os.environ if environ is None else environ,
        remote_client=remote_client,
        device=device,
    )
    layout = block_layout(profile)
    counters = Counters()
    hasher = Hasher(threads=config.copy_threads or None)
    built: list[Tier] = []
    try:
        for name in config.tiers:
            if name not in TIER_ORDER:
                raise ConfigError(f"tiers: unknown tier {name!r}")
            medium = LEVEL_MEDIUMS[name](setting)
            tier: Tier = medium.open(name=name, layout=layout, counters=counters, hasher=hasher)
            built.append(tier)
            tier.ping()
    except BaseException:
        for tier in built:
            tier.close()
        hasher.close()
        raise
    log.info("tiered store for %s: %s", profile.model_id, ", ".join(t.name for t in built))
    return TieredStore(layout=layout, tiers=built, counters=counters, hasher=hasher)
