"""The host pool's key index: an open-addressing table from a key to the slots holding it, changed
under the pool lock and probed without one (tombstones keep probe chains whole; a rebuild runs
under a seqlock counter of its own that sends a racing reader to a full scan)."""

from __future__ import annotations

import struct
import uuid

import numpy as np

from worker.dataplane.tiers.host.pool_layout import FREE, READY, PoolFile

INDEX_EMPTY, INDEX_GONE = 0, 0xFFFFFFFF
"""Key-index buckets hold slot + 1, or one of these (never used, or a removed entry)."""
_U64 = (1 << 64) - 1


def key_words(key: uuid.UUID) -> tuple[int, int]:
    return struct.unpack("<QQ", key.bytes)


def _mix(x: int) -> int:
    """A 64-bit finaliser (MurmurHash3's fmix64): every input bit moves every output bit."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _U64
    return x ^ (x >> 33)


def bucket_of(k0: int, k1: int, mask: int) -> int:
    # Both words, fully mixed: keys in use are uniform hashes, but keys that differ only in a
    # few high bytes (sequential ids) must spread over the buckets too.
    return _mix(k0 ^ _mix(k1)) & mask


class KeyIndex(PoolFile):
    """Finding a key's slots through the pool's key index, and keeping the index up to date."""

    def _ready_slots(self, key: uuid.UUID) -> list[int]:
        """The slots holding `key` READY (more than one only while a put publishes). Exact under
        the lock; without it, a rebuild of the index racing the probe falls back to a scan."""
        k0, k1 = key_words(key)
        slots = self._index_slots(k0, k1)
        if slots is None:
            found = np.flatnonzero((self._keys[:, 0] == k0) & (self._keys[:, 1] == k1) & (self._state == READY))
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
        bucket = bucket_of(k0, k1, mask)
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
        bucket = bucket_of(k0, k1, mask)
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
        bucket = bucket_of(int(self._keys[slot, 0]), int(self._keys[slot, 1]), mask)
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
