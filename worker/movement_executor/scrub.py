"""Scrub: read every READY copy this node holds in a tier and quarantine the ones that fail."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from controlplane.node_api import node_copies
from worker.dataplane.errors import BlockCorrupt, BlockMissing
from worker.movement_executor.copies import quarantine

log = logging.getLogger("strata.movements")


@dataclasses.dataclass
class ScrubReport:
    tier: str
    checked: int = 0
    corrupt: int = 0
    missing: int = 0


def scrub_tier(*, node: str, store: Any, tier: str, buffer: Any, batch: int) -> ScrubReport:
    """Read every READY copy `node` holds in `tier` into `buffer` (a block buffer of `store`'s
    layout) and verify its checksum and size; a copy that fails is quarantined (marked corrupt,
    bytes dropped) and counted."""
    report = ScrubReport(tier=tier)
    if tier not in store.names:
        return report
    for held in node_copies(node, tier, batch=batch):
        for placement, block in ((h.copy, h.block) for h in held):
            if block.size_bytes != store.layout.block_bytes:
                continue  # another model's block: not this store's to judge
            report.checked += 1
            key = block.prefix_key
            problem = ""
            try:
                read = store.tier(tier).get(key, buffer)
                got = read.checksum.hex if read.checksum is not None else ""
                if placement.checksum and got != placement.checksum:
                    problem = f"checksum {got} is not the recorded {placement.checksum}"
                elif placement.size_bytes != read.nbytes:
                    problem = f"{read.nbytes} bytes, {placement.size_bytes} recorded"
            except BlockCorrupt as exc:
                problem = exc.reason
            except BlockMissing:
                problem = "bytes missing"
                report.missing += 1
            if problem:
                report.corrupt += 1
                log.warning("scrub %s: block %s (placement %d): %s", tier, key, placement.id, problem)
                quarantine(store, placement.id, tier, key, found_by="scrub")
    log.info(
        "scrub of %s on node %s: %d copies checked, %d quarantined (%d missing)",
        tier,
        node,
        report.checked,
        report.corrupt,
        report.missing,
    )
    return report
