"""Reconcile: bytes a tier holds against the placements the directory records for this node, and
the tier's usage counters against the bytes it holds."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

from controlplane.node_api import (
    TierLevel,
    checksum_failures_count,
    node_copies,
    node_keys_known,
    placement_mark_corrupt,
    tier_recount_record,
)
from worker.movement_executor.errors import FENCED

log = logging.getLogger("strata.movements")


@dataclasses.dataclass
class ReconcileReport:
    tier: str
    orphans_seen: int = 0
    orphans_deleted: int = 0
    missing_marked: int = 0
    recounted: bool = False
    """The tier's usage counters were recounted (False: it keeps none that can drift, or
    another node was recounting the shared tier)."""
    drift_bytes: int = 0
    """Counted minus held, as the recount found (and corrected) them."""
    drift_blocks: int = 0


class Reconciler:
    """Deletes bytes no placement names once they stayed orphaned for `grace_s` (remembered
    across reconciles of this process), marks READY copies whose bytes are gone corrupt, and
    recounts the tier's usage counters from what it holds."""

    def __init__(self, *, node: str, store: Any, grace_s: float, batch: int) -> None:
        self.node = node
        self.store = store
        self.grace_s = grace_s
        self.batch = batch
        self._orphans: dict[tuple[str, uuid.UUID], float] = {}
        """(tier, key) of bytes without a placement -> when a reconcile first saw them so."""
        self._lock = threading.Lock()

    def reconcile(self, tier: str, *, now: float | None = None) -> ReconcileReport:
        """Bytes without a placement row are deleted (after the grace period: seen orphaned by a
        reconcile at least that long ago); READY rows whose bytes are gone are marked corrupt;
        then the tier's usage counters are recounted and the drift recorded for /metrics."""
        report = ReconcileReport(tier=tier)
        if tier not in self.store.names:
            return report
        now = time.monotonic() if now is None else now
        # Rows first, then bytes: a copy written after the listing cannot look missing.
        ready = [
            (held.copy.id, held.copy.epoch, held.block.prefix_key)
            for found in node_copies(self.node, tier, batch=self.batch)
            for held in found
        ]
        present = set(self.store.tier(tier).keys())
        for ident, epoch, key in ready:
            if key in present or self.store.tier(tier).contains(key):
                continue
            try:
                placement_mark_corrupt(placement_id=ident, epoch=epoch)
            except FENCED:
                continue
            report.missing_marked += 1
            checksum_failures_count(tier=tier, found_by="reconcile")
            log.warning("reconcile %s: placement %d (block %s) has no bytes: marked corrupt", tier, ident, key)
        known = self._known_keys(tier, present)
        with self._lock:
            for key in present - known:
                report.orphans_seen += 1
                first = self._orphans.setdefault((tier, key), now)
                if now - first >= self.grace_s and key not in self._known_keys(tier, {key}):
                    self.store.tier(tier).delete(key)
                    self._orphans.pop((tier, key), None)
                    report.orphans_deleted += 1
            for tier_key in [k for k in self._orphans if k[0] == tier and k[1] in known]:
                self._orphans.pop(tier_key, None)
        if report.orphans_deleted or report.missing_marked:
            log.warning(
                "reconcile of %s on node %s: %d orphan block(s) deleted, %d copies without bytes marked corrupt",
                tier,
                self.node,
                report.orphans_deleted,
                report.missing_marked,
            )
        self._recount(tier, report)
        return report

    def _recount(self, tier: str, report: ReconcileReport) -> None:
        """Recount the tier's usage counters (after the deletions above, which they account),
        record the drift, and say so in one line when there was one to correct."""
        recount = self.store.tier(tier).recount()
        if recount is None:
            return
        report.recounted = True
        report.drift_bytes, report.drift_blocks = recount.drift_bytes, recount.drift_blocks
        shared = tier == TierLevel.REMOTE
        tier_recount_record(
            node=None if shared else self.node,
            tier=tier,
            drift_bytes=recount.drift_bytes,
            drift_blocks=recount.drift_blocks,
        )
        if recount.corrected:
            usage = recount.usage
            log.warning(
                "recount of %s: its usage counters were off by %+d bytes (%+d blocks) from what it holds "
                "and are corrected; now %d of %d bytes used (%d stored in %d blocks, %d being written)",
                f"the shared {tier} tier" if shared else f"tier {tier} on node {self.node}",
                recount.drift_bytes,
                recount.drift_blocks,
                usage.used_bytes,
                usage.capacity_bytes,
                usage.stored_bytes,
                usage.blocks,
                usage.pending_bytes,
            )

    def _known_keys(self, tier: str, keys: set[uuid.UUID]) -> set[uuid.UUID]:
        """Which of `keys` have a placement row of any state in this node's `tier`."""
        return node_keys_known(self.node, tier, keys)
