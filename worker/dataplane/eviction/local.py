"""Room in a full local tier at write-back, made at once on the node by the tier's policy.

    store_block -> evictor.put(tier, key, ...)
        namespace over its quota in the tier? -> evict its own coldest blocks (reason quota),
                                                 or refuse the write when it has none left
        tier full? -> evict the tier's coldest blocks (reason ttl when idle past the TTL,
                      else pressure), one at a time, until the block fits or none is left
    each evicted copy -> a PlacementChange "delete", sent to the directory with the next batch
    a delete that fails -> the block stays in the ledger (a later eviction tries it again),
                           counted; the next coldest goes instead (MAX_FAILED_DELETES per put)

A new block is refused only when nothing in the tier is colder: every other block pinned, or
written by the same batch (one request's write-back) at an earlier place in the prompt - a block
is no use without the blocks before it, so a batch never evicts its own prefix to store its tail.
All blocks of one batch count as written at the same moment (the batch's first put), so among
them the deepest leave first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable

from worker.dataplane.counters import Counters
from worker.dataplane.directory import PlacementChange
from worker.dataplane.errors import DataplaneError, TierFull
from worker.dataplane.eviction.ledger import BlockStat, Ledger
from worker.dataplane.eviction.rules import Rules, victim_order
from worker.dataplane.tiers.base import PutResult, Tier

log = logging.getLogger("strata.eviction")

SYNC_SECONDS = 30.0
"""How often at most a full tier's keys are read to match the ledger to them (blocks a movement
put in or took out): the first time the tier is full, then at most once per this interval."""

MAX_FAILED_DELETES = 3
"""Failed deletes one put (or one TTL pass) tolerates before it gives up with the last one's
error: one bad block is skipped for the next coldest, a medium that fails every delete fails the
write instead of trying every block in the tier."""


class WriteRefused(Exception):
    """Nothing in the tier may leave to make room for the block (or its namespace's quota)."""

    def __init__(self, tier: str, key: uuid.UUID, reason: str) -> None:
        super().__init__(f"{tier}: no room for block {key} ({reason}) and nothing evictable")
        self.tier = tier
        self.key = key
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Eviction:
    tier: str
    key: uuid.UUID
    namespace: str
    reason: str


class LocalEvictor:
    """Evicts blocks of this node's local tiers by the rules in force, keeps the ledger, and
    queues the directory changes the evictions make."""

    def __init__(
        self,
        *,
        model_key: uuid.UUID,
        node: str,
        counters: Counters | None = None,
        rules: Rules | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, uuid.UUID], None] | None = None,
    ) -> None:
        self.model_key = model_key
        self.on_evict = on_evict
        """Told of each copy evicted (tier, key), after the tier dropped it."""
        self.node = node
        self.counters = counters if counters is not None else Counters()
        self.rules = rules if rules is not None else Rules()
        self.clock = clock
        self.ledger = Ledger()
        self._lock = threading.RLock()
        self._pending: list[PlacementChange] = []
        self._stamp: float | None = None
        self._synced_at: dict[str, float] = {}
        """The clock at the current batch's first put (None between batches)."""
        self.evicted: collections.Counter[tuple[str, str]] = collections.Counter()
        """(tier, reason) -> evictions; also counted as `eviction.<tier>.<reason>`."""

    # -- writes --------------------------------------------------------------------------------
    def put(
        self,
        tier: Tier,
        key: uuid.UUID,
        write: Callable[[], PutResult],
        *,
        namespace: str,
        position: int = 0,
        tokens: int = 0,
    ) -> PutResult:
        """Run `write` (a put of `key` into `tier`), first making room for the namespace's quota
        and, when the tier is full, for the block. Raises WriteRefused (counted) when nothing may
        leave; other tier errors pass through."""
        nbytes = tier.layout.block_bytes
        with self._lock:
            if self._stamp is None:
                self._stamp = self.clock()
            quota = self.rules.quota(namespace, tier.name)
            if quota is not None:
                self._within_quota(tier, key, namespace=namespace, quota=quota, nbytes=nbytes, position=position)
            synced = False
            failed = _FailedDeletes()
            while True:
                try:
                    result = write()
                except TierFull:
                    if not synced and self.clock() - self._synced_at.get(tier.name, -math.inf) >= SYNC_SECONDS:
                        self._sync(tier, nbytes)
                        synced = True
                    victim = self._coldest(tier, key, position, skip=failed.keys)
                    if victim is None and not synced:
                        self._sync(tier, nbytes)
                        synced = True
                        continue
                    if victim is None:
                        failed.raise_last()
                        self._refuse(tier.name, key, "pressure")
                    assert victim is not None
                    self._evict(tier, victim, self._reason(tier.name, victim), failed)
                    continue
                self.ledger.record_put(
                    tier.name,
                    key,
                    namespace=namespace,
                    nbytes=nbytes,
                    now=self._stamp,
                    position=position,
                    tokens=tokens,
                )
                return result

    def touch(self, tier: str, keys: list[uuid.UUID]) -> None:
        """The request whose write-back comes next used `keys` from `tier`: they count as used at
        the batch's moment, so its new blocks never evict the prefix they extend."""
        with self._lock:
            if self._stamp is None:
                self._stamp = self.clock()
            self.ledger.record_access(tier, keys, now=self._stamp)

    def forget(self, tier: str, key: uuid.UUID) -> None:
        """The block left the tier by another path (quarantine, a movement)."""
        self.ledger.forget(tier, key)

    def expire(self, tier: Tier) -> int:
        """Evict the tier's blocks idle past its TTL (reason ttl); returns how many left. A block
        whose delete fails stays for the next pass (counted); after MAX_FAILED_DELETES the pass
        stops, the medium looking broken."""
        rule = self.rules.tier(tier.name)
        if rule.ttl_seconds is None:
            return 0
        now = self.clock()
        gone = 0
        failed = _FailedDeletes()
        with self._lock:
            for stat in self.ledger.stats(tier.name):
                if not stat.pinned and rule.is_expired(now - stat.last_access):
                    try:
                        gone += self._evict(tier, stat, "ttl", failed)
                    except (DataplaneError, OSError):
                        break
        return gone

    def take_changes(self) -> list[PlacementChange]:
        """The directory changes queued since the last call (sent with the next batch)."""
        with self._lock:
            changes, self._pending = self._pending, []
            self._stamp = None
            return changes

    # -- internals -----------------------------------------------------------------------------
    def _sync(self, tier: Tier, nbytes: int) -> None:
        """Match the ledger to what the tier holds (blocks moved in or out by other paths)."""
        self.ledger.sync(tier.name, tier.keys(), nbytes=nbytes, now=self.clock())
        self._synced_at[tier.name] = self.clock()

    def _within_quota(
        self, tier: Tier, key: uuid.UUID, *, namespace: str, quota: int, nbytes: int, position: int
    ) -> None:
        if nbytes > quota:
            self._refuse(tier.name, key, "quota")
        failed = _FailedDeletes()
        while self.ledger.bytes_of(tier.name, namespace) + nbytes > quota:
            own = [
                stat
                for stat in self._candidates(tier, key, position)
                if stat.namespace == namespace and stat.key not in failed.keys
            ]
            order = victim_order(own, self.rules.tier(tier.name), now=self.clock(), weight=self.rules)
            if not order:
                failed.raise_last()
                self._refuse(tier.name, key, "quota")
            self._evict(tier, order[0], "quota", failed)

    def _candidates(self, tier: Tier, key: uuid.UUID, position: int) -> list[BlockStat]:
        """The tier's blocks that may leave for `key`: not itself, nor its batch's shallower blocks."""
        return [
            stat
            for stat in self.ledger.stats(tier.name)
            if stat.key != key and not (stat.last_access == self._stamp and stat.position < position)
        ]

    def _coldest(self, tier: Tier, key: uuid.UUID, position: int, *, skip: set[uuid.UUID]) -> BlockStat | None:
        stats = [stat for stat in self._candidates(tier, key, position) if stat.key not in skip]
        order = victim_order(stats, self.rules.tier(tier.name), now=self.clock(), weight=self.rules)
        return order[0] if order else None

    def _reason(self, tier: str, stat: BlockStat) -> str:
        return "ttl" if self.rules.tier(tier).is_expired(self.clock() - stat.last_access) else "pressure"

    def _evict(self, tier: Tier, stat: BlockStat, reason: str, failed: _FailedDeletes) -> bool:
        """Delete the block and queue its directory change; False when it was gone already. A
        delete that fails keeps the block in the ledger (a later eviction tries it again),
        counted as `eviction_failed.<tier>` and noted in `failed`, which raises the error once
        MAX_FAILED_DELETES have failed."""
        try:
            removed = tier.delete(stat.key)
        except (DataplaneError, OSError) as exc:
            self.counters.add(f"eviction_failed.{tier.name}")
            log.warning(
                "evicting %s from %s failed, the block stays for a later eviction: %s", stat.key, tier.name, exc
            )
            failed.add(stat.key, exc)
            return False
        self.ledger.forget(tier.name, stat.key)
        if not removed:
            return False  # gone by another path already: not an eviction
        self.evicted[(tier.name, reason)] += 1
        self.counters.add(f"eviction.{tier.name}.{reason}")
        if self.on_evict is not None:
            self.on_evict(tier.name, stat.key)
        log.debug("evicted %s from %s (%s, %s)", stat.key, tier.name, reason, stat.namespace or "namespace unknown")
        if stat.namespace:
            self._pending.append(
                PlacementChange(
                    namespace=stat.namespace,
                    model_key=self.model_key,
                    prefix_key=stat.key,
                    tier=tier.name,
                    node=self.node,
                    action="delete",
                )
            )
        else:
            self.counters.add("eviction.unreported")
        return True

    def _refuse(self, tier: str, key: uuid.UUID, reason: str) -> None:
        self.counters.add(f"write_back_refused.{tier}.{reason}")
        raise WriteRefused(tier, key, reason)


class _FailedDeletes:
    """The blocks whose delete failed during one put or TTL pass, and the last failure."""

    def __init__(self) -> None:
        self.keys: set[uuid.UUID] = set()
        self.last: BaseException | None = None

    def add(self, key: uuid.UUID, error: BaseException) -> None:
        self.keys.add(key)
        self.last = error
        if len(self.keys) >= MAX_FAILED_DELETES:
            raise error

    def raise_last(self) -> None:
        """Raise the last delete's error, if one failed: nothing else was left to evict."""
        if self.last is not None:
            raise self.last
