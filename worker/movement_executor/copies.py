"""The quarantine of a copy that failed a check: shared by scrub, reconcile and the executor."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from controlplane.node_api import checksum_failures_count, placement_mark_corrupt
from worker.dataplane.errors import TierUnavailable
from worker.movement_executor.errors import FENCED

log = logging.getLogger("strata.movements")


def quarantine(store: Any, placement_id: int, tier: str, key: uuid.UUID, *, found_by: str) -> None:
    """A copy that failed verification is never served again: mark it corrupt, drop its bytes
    (the tier already dropped them if its own read found the damage), count it."""
    try:
        placement_mark_corrupt(placement_id=placement_id)
    except FENCED:
        pass
    try:
        store.tier(tier).delete(key)
    except TierUnavailable:
        pass
    checksum_failures_count(tier=tier, found_by=found_by)
    log.warning("%s copy of block %s (placement %d) failed verification: quarantined", tier, key, placement_id)
