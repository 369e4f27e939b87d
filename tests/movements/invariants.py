"""The invariants every fault must leave intact (DESIGN.md §5), checked against the real bytes.

I1: every READY placement points at bytes that exist, have the recorded size and pass the
checksum. I2: a copy found corrupt is never READY (it is quarantined, so never served). I3: no
block has two movements in flight. I4: no bytes without a placement row (after a reconcile).

The bytes are read as the media hold them (`Tier.stored_bytes`) and hashed here, apart from the
tiers' own read path, so a bug there cannot hide a violation. Used by the fault tests and the soak test.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from django.db import connection

from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.models import Node, Placement
from controlplane.movements.choices import IN_FLIGHT


@dataclasses.dataclass(frozen=True)
class Violation:
    invariant: str
    block_id: int
    placement_id: int
    tier: str
    node: str
    problem: str


@dataclasses.dataclass
class InvariantReport:
    checked: int = 0
    """READY copies whose bytes were read and verified."""
    violations: list[Violation] = dataclasses.field(default_factory=list)
    orphans: list[tuple[str, str, uuid.UUID]] = dataclasses.field(default_factory=list)
    """(node, tier, key) of bytes no placement row names (empty node: the remote tier)."""
    double_in_flight: list[int] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No violation of I1-I3 and no orphan (I4 holds once a reconcile has run)."""
        return not self.violations and not self.orphans and not self.double_in_flight


def _checksum_of(key: uuid.UUID, data: memoryview, layout: Any) -> str:
    from worker.dataplane.checksum import BlockChecksum, layer_checksum

    sums = [
        layer_checksum(key, layer, data[layer * layout.layer_bytes : (layer + 1) * layout.layer_bytes])
        for layer in range(layout.layers)
    ]
    return BlockChecksum.from_layers(key, sums).hex


def invariants_check(*, stores: Mapping[str, Any], orphans: bool = True) -> InvariantReport:
    """Check I1-I4 for the nodes whose stores are given (node name -> TieredStore of that node,
    opened on the same media), and for the shared remote tier through the first store that has it."""
    report = InvariantReport()
    remote_store = next((s for s in stores.values() if "remote" in s.names), None)
    scopes: list[tuple[str, int | None, str, Any]] = []
    for name, store in stores.items():
        node_id = Node.objects.filter(name=name).values_list("id", flat=True).first()
        for tier in store.names:
            if tier not in (TierLevel.DEVICE, TierLevel.REMOTE) and node_id is not None:
                scopes.append((name, node_id, tier, store.tier(tier)))
    if remote_store is not None:
        scopes.append(("", None, TierLevel.REMOTE, remote_store.tier(TierLevel.REMOTE)))
    for node, node_id, tier, backend in scopes:
        rows = (
            Placement.objects.filter(node_id=node_id, tier=tier)
            if node_id is not None
            else Placement.objects.filter(node__isnull=True, tier=tier)
        ).select_related("block")
        known: set[uuid.UUID] = set()
        for p in rows.order_by("id").iterator(chunk_size=500):
            key = p.block.prefix_key
            known.add(key)
            if p.state != PlacementState.READY:
                continue
            if p.size_bytes != backend.layout.block_bytes:
                continue  # another model's block: not this store's layout
            report.checked += 1
            raw = backend.stored_bytes(key)
            problem = ""
            if raw is None:
                problem = "bytes missing"
            elif len(raw) != p.size_bytes:
                problem = f"{len(raw)} bytes stored, {p.size_bytes} recorded"
            elif p.checksum and _checksum_of(key, memoryview(raw), backend.layout) != p.checksum:
                problem = "checksum mismatch"
            if problem:
                report.violations.append(Violation("I1", p.block_id, p.id, tier, node, problem))
        if orphans:
            for key in sorted(set(backend.keys()) - known):
                report.orphans.append((node, tier, key))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT block_id FROM movements_movement WHERE state = ANY(%s) GROUP BY block_id HAVING count(*) > 1",
            [[s.value for s in IN_FLIGHT]],
        )
        report.double_in_flight = [row[0] for row in cursor.fetchall()]
    return report
