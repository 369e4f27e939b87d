"""This node's copies as the directory lists them, and the quarantine of a copy that failed a check."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.models import Node, Placement
from controlplane.directory.services import placement_mark_corrupt
from controlplane.movements.services import checksum_failures_count
from worker.dataplane.errors import TierUnavailable
from worker.movements.errors import FENCED

log = logging.getLogger("strata.movements")


def node_copies(
    node: str, tier: str, *, batch: int, states: Sequence[str] = (PlacementState.READY,)
) -> Iterator[list[Placement]]:
    """`node`'s copies in `tier` (the shared ones for remote), in id-ordered batches of `batch`."""
    node_id = None if tier == TierLevel.REMOTE else Node.objects.filter(name=node).values_list("id", flat=True).first()
    if tier != TierLevel.REMOTE and node_id is None:
        return
    last = 0
    while True:
        rows = Placement.objects.filter(tier=tier, state__in=states, id__gt=last)
        rows = rows.filter(node__isnull=True) if node_id is None else rows.filter(node_id=node_id)
        found = list(rows.select_related("block").order_by("id")[:batch])
        if not found:
            return
        last = found[-1].id
        yield found


def quarantine(store: Any, placement: Placement, tier: str, key: uuid.UUID, *, found_by: str) -> None:
    """A copy that failed verification is never served again: mark it corrupt, drop its bytes
    (the tier already dropped them if its own read found the damage), count it."""
    try:
        placement_mark_corrupt(placement_id=placement.id)
    except FENCED:
        pass
    try:
        store.tier(tier).delete(key)
    except TierUnavailable:
        pass
    checksum_failures_count(tier=tier, found_by=found_by)
    log.warning("%s copy of block %s (placement %d) failed verification: quarantined", tier, key, placement.id)
