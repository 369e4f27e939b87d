"""What this node knows of each block in each of its local tiers: when it came and was last used,
how often it was used, whose it is, its size and place in the prompt, and whether it is pinned.

The eviction rules rank blocks on these numbers. The ledger learns of a block when write-back
stores it and of each use when a request hits it; a block found in a tier that the ledger never
saw (put there by a movement, or kept from before a restart) is adopted as used once, now.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from collections.abc import Iterable


@dataclasses.dataclass(slots=True)
class BlockStat:
    key: uuid.UUID
    namespace: str
    nbytes: int
    inserted: float
    last_access: float
    accesses: int = 1
    position: int = 0
    """The block's first token's offset in its prompt."""
    tokens: int = 0
    pinned: bool = False


class Ledger:
    """Per-tier, per-block statistics; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._tiers: dict[str, dict[uuid.UUID, BlockStat]] = collections.defaultdict(dict)
        self._pins: collections.Counter[uuid.UUID] = collections.Counter()

    def record_put(
        self,
        tier: str,
        key: uuid.UUID,
        *,
        namespace: str,
        nbytes: int,
        now: float,
        position: int = 0,
        tokens: int = 0,
    ) -> BlockStat:
        """A block stored in `tier` (its first access)."""
        with self._lock:
            stat = BlockStat(
                key=key,
                namespace=namespace,
                nbytes=nbytes,
                inserted=now,
                last_access=now,
                position=position,
                tokens=tokens,
                pinned=self._pins[key] > 0,
            )
            self._tiers[tier][key] = stat
            return stat

    def record_access(self, tier: str, keys: Iterable[uuid.UUID], *, now: float) -> None:
        """One use of each of `keys` in `tier` (unknown keys are ignored)."""
        with self._lock:
            held = self._tiers.get(tier, {})
            for key in keys:
                stat = held.get(key)
                if stat is not None:
                    stat.accesses += 1
                    stat.last_access = now

    def forget(self, tier: str, key: uuid.UUID) -> BlockStat | None:
        with self._lock:
            return self._tiers.get(tier, {}).pop(key, None)

    def get(self, tier: str, key: uuid.UUID) -> BlockStat | None:
        with self._lock:
            return self._tiers.get(tier, {}).get(key)

    def stats(self, tier: str) -> list[BlockStat]:
        """Copies of the tier's block statistics."""
        with self._lock:
            return [dataclasses.replace(stat) for stat in self._tiers.get(tier, {}).values()]

    def bytes_of(self, tier: str, namespace: str) -> int:
        with self._lock:
            return sum(stat.nbytes for stat in self._tiers.get(tier, {}).values() if stat.namespace == namespace)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._tiers.values())

    def sync(self, tier: str, present: Iterable[uuid.UUID], *, nbytes: int, now: float) -> None:
        """Match the ledger to the keys the tier really holds: forget blocks gone by other paths,
        adopt blocks it never saw (namespace unknown, used once, now)."""
        present = set(present)
        with self._lock:
            held = self._tiers[tier]
            for key in [key for key in held if key not in present]:
                del held[key]
            for key in present - held.keys():
                held[key] = BlockStat(
                    key=key, namespace="", nbytes=nbytes, inserted=now, last_access=now, pinned=self._pins[key] > 0
                )

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, keys: Iterable[uuid.UUID]) -> None:
        """Keep `keys` in every tier until as many `unpin`s (e.g. while a request reads them)."""
        with self._lock:
            for key in keys:
                self._pins[key] += 1
                self._mark(key, True)

    def unpin(self, keys: Iterable[uuid.UUID]) -> None:
        with self._lock:
            for key in keys:
                if self._pins[key] > 0:
                    self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]
                    self._mark(key, False)

    def _mark(self, key: uuid.UUID, pinned: bool) -> None:
        for held in self._tiers.values():
            stat = held.get(key)
            if stat is not None:
                stat.pinned = pinned
