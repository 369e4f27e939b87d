"""The host pool's slots: allocation from the free-slot stack, release, and reclaiming the slots
of writers that died (all under the pool lock)."""

from __future__ import annotations

import logging
import os
import uuid

import numpy as np

from worker.dataplane.errors import TierFull
from worker.dataplane.tiers.host.key_index import KeyIndex, key_words
from worker.dataplane.tiers.host.pool_layout import FREE, WRITING

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotTable(KeyIndex):
    """Slot bookkeeping of the host pool (callers hold the lock where a method says so)."""

    def _release(self, slot: int) -> None:
        if self._gen[slot] % 2 == 0:
            self._gen[slot] += 1
        keyed = self._state[slot] != FREE
        self._state[slot] = FREE  # first: a rebuild the removal may run skips this slot
        if keyed:
            self._index_remove(slot)
        self._keys[slot] = 0
        self._nbytes[slot] = 0
        self._pid[slot] = 0
        self._gen[slot] += 1
        top = int(self._control[0])
        self._free[top] = slot
        self._control[0] = top + 1

    def _reclaim_dead_writers(self) -> int:
        reclaimed = 0
        for slot in np.flatnonzero(self._state == WRITING):
            if not pid_alive(int(self._pid[slot])):
                self._release(int(slot))
                reclaimed += 1
        if reclaimed:
            log.warning("host pool %s: reclaimed %d slots left by crashed writers", self.path, reclaimed)
        return reclaimed

    def _allocate(self, key: uuid.UUID) -> int:
        with self._locked():
            if int(self._control[0]) == 0 and not self._reclaim_dead_writers():
                self.counters.add(f"{self.name}.full")
                raise TierFull(self.name, needed=self.layout.block_bytes, free=0)
            top = int(self._control[0]) - 1
            slot = int(self._free[top])
            self._control[0] = top
            self._gen[slot] += 1  # odd: the slot is changing
            self._state[slot] = WRITING
            self._pid[slot] = os.getpid()
            k0, k1 = key_words(key)
            self._keys[slot] = (k0, k1)
            self._index_add(slot, k0, k1)
            return slot
