"""The engine's L1 working set: which blocks stay in the device tier, the coldest out first by the
device tier's policy (least recently used by default), with each priority class held to its share
of the tier.

L1 is not registered in the directory (it changes with every request); the control plane steers
it through priority classes instead: a class with `device_share` 0.1 may hold at most a tenth of
the device pool, so in chat-peak mode a batch tenant's long documents cannot push the realtime
tenants' prefixes out. A block of a class over its share evicts that class's own oldest blocks
first; only when the whole pool is full do other classes' oldest blocks go. Which blocks are
coldest follows the device tier's policy in force (`set_rule`: algorithm, TTL, min_accesses, class
weights; a mode's override arrives already resolved), ranked by `eviction.rules.victim_order`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping

import torch

from worker.dataplane.counters import Counters
from worker.dataplane.directory import DEFAULT_CLASS
from worker.dataplane.errors import TierFull
from worker.dataplane.eviction.ledger import BlockStat
from worker.dataplane.eviction.rules import Rules, TierRule, victim_order
from worker.dataplane.tier_names import DEVICE
from worker.dataplane.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ClassShare:
    """A priority class as the node sees it: the namespaces it covers and its device share."""

    name: str
    device_share: float = 1.0
    namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: a priority class needs a name")
        share = self.device_share
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or math.isnan(share)
            or not 0.0 <= share <= 1.0
        ):
            raise ValueError(f"device_share: class {self.name!r} needs a fraction between 0 and 1, got {share!r}")
        object.__setattr__(self, "namespaces", tuple(self.namespaces))

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ClassShare:
        """From the JSON the control plane sends (extra fields such as `weight` are ignored)."""
        if not isinstance(data, dict):
            raise ValueError(f"a priority class must be an object, got {type(data).__name__}")
        namespaces = data.get("namespaces", ())
        if isinstance(namespaces, str) or not isinstance(namespaces, (list, tuple)):
            raise ValueError(f"namespaces: class {data.get('name')!r} needs a list of namespace names")
        return cls(
            name=str(data.get("name", "")),
            device_share=data.get("device_share", 1.0),  # type: ignore[arg-type]
            namespaces=tuple(str(n) for n in namespaces),
        )


class WorkingSet:
    """The blocks this engine keeps in its device tier, evicted by the device tier's rule, with
    per-class byte caps."""

    def __init__(
        self, tier: Tier, *, counters: Counters | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tier = tier
        self.counters = counters if counters is not None else Counters()
        self.capacity_bytes = tier.usage().capacity_bytes
        self.block_bytes = tier.layout.block_bytes
        self._lock = threading.RLock()
        self._lru: collections.OrderedDict[uuid.UUID, str] = collections.OrderedDict()  # key -> namespace
        self._bytes: collections.Counter[str] = collections.Counter()
        self._shares: dict[str, float] = {}
        self._class_of: dict[str, str] = {}
        self.version = 0
        self.clock = clock
        self.rule = TierRule(tier=DEVICE)
        self._rules = Rules()
        self._stats: dict[uuid.UUID, BlockStat] = {}

    def set_rule(
        self, rule: TierRule, *, weights: Mapping[str, float] | None = None, default_weight: float = 1.0
    ) -> None:
        """Evict by `rule` (and the class weights by namespace) from now on; blocks already idle
        past a new TTL leave now."""
        with self._lock:
            self.rule = rule
            self._rules = Rules(weights=dict(weights or {}), default_weight=default_weight)
            self._expire()
        log.info(
            "device working set: %s, ttl %s, min_accesses %d",
            rule.algorithm,
            f"{rule.ttl_seconds:g}s" if rule.ttl_seconds is not None else "none",
            rule.min_accesses,
        )

    # -- policy --------------------------------------------------------------------------------
    def set_shares(self, classes: Iterable[ClassShare], *, version: int = 0) -> None:
        """Apply the control plane's priority classes. Blocks already over a class's new share
        are evicted now, oldest first, so the cap holds from this moment on."""
        classes = list(classes)
        with self._lock:
            self._shares = {c.name: c.device_share for c in classes}
            self._class_of = {ns: c.name for c in classes for ns in c.namespaces}
            self.version = version
            self._bytes = collections.Counter()
            for namespace in self._lru.values():
                self._bytes[self.class_of(namespace)] += self.block_bytes
            for name in list(self._bytes):
                self._shrink(name, self.cap_bytes(name))
        log.info(
            "device working set: policy version %d, shares %s",
            version,
            ", ".join(f"{c.name} {c.device_share:.0%}" for c in classes) or "none",
        )

    def class_of(self, namespace: str) -> str:
        return self._class_of.get(namespace, DEFAULT_CLASS)

    def cap_bytes(self, name: str) -> int:
        """Bytes class `name` may hold: its share of the pool, whole blocks only."""
        share = self._shares.get(name, 1.0)
        return int(share * self.capacity_bytes) // self.block_bytes * self.block_bytes

    # -- blocks --------------------------------------------------------------------------------
    def put(self, key: uuid.UUID, block: torch.Tensor, *, namespace: str) -> bool:
        """Keep a copy of `block`; False when it is already kept or its class may hold none."""
        with self._lock:
            if key in self._lru:
                self._used(key)
                return False
            self._expire()
            if self.tier.contains(key):  # kept by someone else (e.g. a test); adopt it
                self._remember(key, namespace)
                return False
            name = self.class_of(namespace)
            cap = self.cap_bytes(name)
            if cap < self.block_bytes:
                self.counters.add("device.share_refused")
                return False
            if cap < self.capacity_bytes:
                self._shrink(name, cap - self.block_bytes)
            while True:
                try:
                    self.tier.put(key, block)
                except TierFull:
                    if not self._lru:
                        return False
                    victim = self._coldest(self._lru)
                    self._evict(victim, reason="device.evicted")
                    continue
                self._remember(key, namespace)
                return True

    def touch(self, key: uuid.UUID) -> None:
        with self._lock:
            if key in self._lru:
                self._used(key)

    def forget(self, key: uuid.UUID) -> None:
        """The block is no longer in the tier (a failed read dropped it)."""
        with self._lock:
            namespace = self._lru.pop(key, None)
            self._stats.pop(key, None)
            if namespace is not None:
                self._bytes[self.class_of(namespace)] -= self.block_bytes

    def __contains__(self, key: uuid.UUID) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def used_bytes(self, name: str | None = None) -> int:
        with self._lock:
            return sum(self._bytes.values()) if name is None else self._bytes[name]

    def usage_by_class(self) -> dict[str, int]:
        with self._lock:
            return {name: used for name, used in sorted(self._bytes.items()) if used}

    # -- internals -----------------------------------------------------------------------------
    def _remember(self, key: uuid.UUID, namespace: str) -> None:
        self._lru[key] = namespace
        now = self.clock()
        self._stats[key] = BlockStat(
            key=key, namespace=namespace, nbytes=self.block_bytes, inserted=now, last_access=now
        )
        self._bytes[self.class_of(namespace)] += self.block_bytes

    def _used(self, key: uuid.UUID) -> None:
        self._lru.move_to_end(key)
        stat = self._stats.get(key)
        if stat is not None:
            stat.accesses += 1
            stat.last_access = self.clock()

    def _coldest(self, keys: Iterable[uuid.UUID]) -> uuid.UUID:
        """The coldest of `keys` (not empty) by the rule in force; plain LRU reads the order kept."""
        keys = list(keys)
        rule = self.rule
        if rule.algorithm == "lru" and rule.ttl_seconds is None and not rule.min_accesses and not self._rules.weights:
            return keys[0]
        stats = [self._stats[key] for key in keys if key in self._stats]
        order = victim_order(stats, rule, now=self.clock(), weight=self._rules)
        return order[0].key if order else keys[0]

    def _expire(self) -> None:
        """Evict blocks idle past the rule's TTL."""
        if self.rule.ttl_seconds is None:
            return
        now = self.clock()
        for key in [key for key, stat in self._stats.items() if self.rule.is_expired(now - stat.last_access)]:
            self._evict(key, reason="device.expired")

    def _shrink(self, name: str, limit: int) -> None:
        """Evict class `name`'s oldest blocks until it holds at most `limit` bytes."""
        if self._bytes[name] <= limit:
            return
        while self._bytes[name] > limit:
            members = [k for k, namespace in self._lru.items() if self.class_of(namespace) == name]
            if not members:
                break
            self._evict(self._coldest(members), reason="device.share_evicted")

    def _evict(self, key: uuid.UUID, *, reason: str) -> None:
        self.forget(key)
        self.tier.delete(key)
        self.counters.add(reason)
