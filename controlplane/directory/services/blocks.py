"""Directory writes about blocks: registration (through the shared registration writer), access
counts and purges."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

from django.db import connection, transaction
from django.utils import timezone

from controlplane.directory import queries
from controlplane.directory.errors import (
    UnknownModel,
    UnknownNamespace,
)
from controlplane.directory.models import ModelProfile, Namespace
from controlplane.directory.registrations import registrations_write
from controlplane.directory.selectors import sql_cursor
from controlplane.events import send_event_on_commit
from worker.dataplane.directory import BlockRegistration, BlockTouch


@transaction.atomic
def blocks_register(
    *, registrations: Sequence[BlockRegistration], source: str = "api", now: datetime | None = None
) -> queries.RegisterCounts:
    """Record blocks and one READY copy of each, all or nothing: a batch naming an unknown
    namespace, model or node writes nothing. Idempotent, and safe when two processes register the
    same blocks at once (an upsert in key order; an identical copy is left untouched)."""
    if not registrations:
        return queries.RegisterCounts(blocks=0, placements=0)
    now = now or timezone.now()
    with sql_cursor() as cursor:
        counts = registrations_write(cursor, registrations=registrations, now=now, all_or_nothing=True).counts
    blocks_registered_announce(
        blocks=len(registrations), new=counts.blocks, placements=counts.placements, source=source
    )
    return counts


def blocks_registered_announce(*, blocks: int, new: int, placements: int, source: str) -> None:
    """One dashboard event per batch (never per block): how many blocks a batch carried and how
    many of them, and of their copies, were new."""
    send_event_on_commit(
        kind="blocks.registered", payload={"blocks": blocks, "new": new, "placements": placements, "source": source}
    )


@transaction.atomic
def blocks_touch(*, touches: Sequence[BlockTouch]) -> int:
    """Add accesses to blocks (summed per block, the latest time kept); unknown keys are ignored.
    Returns the number of blocks updated."""
    rows = [
        queries.TouchRow(
            namespace=t.namespace,
            model_key=t.model_key,
            prefix_key=t.prefix_key,
            hits=t.hits,
            at=datetime.fromtimestamp(t.at, tz=UTC),
        )
        for t in touches
    ]
    with sql_cursor() as cursor:
        return queries.touch(cursor, rows=rows)


@dataclasses.dataclass(frozen=True)
class PurgeCounts:
    blocks: int
    placements: int


@transaction.atomic
def blocks_purge(*, namespace: str, model: str | None = None) -> PurgeCounts:
    """Forget every block of a namespace (and model profile, when named) with its copies. The bytes
    left on nodes have no placement any more: the reconciler collects them."""
    ns = Namespace.objects.filter(name=namespace).first()
    if ns is None:
        raise UnknownNamespace(f"namespace: no namespace named {namespace!r}")
    profile = None
    if model is not None:
        profile = ModelProfile.objects.filter(name=model).first()
        if profile is None:
            raise UnknownModel(f"model: no model profile named {model!r}")
    where = "b.namespace_id = %s" + (" AND b.model_id = %s" if profile else "")
    params = [ns.id] + ([profile.id] if profile else [])
    # Set-based deletes: the ORM's cascade would load every row into Python first.
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {queries.PLACEMENT_TABLE} p USING {queries.BLOCK_TABLE} b "
            f"WHERE p.block_id = b.id AND {where}",
            params,
        )
        placements = cursor.rowcount
        cursor.execute(f"DELETE FROM {queries.BLOCK_TABLE} b WHERE {where}", params)
        blocks = cursor.rowcount
    send_event_on_commit(
        kind="blocks.purged",
        payload={"namespace": namespace, "model": model or "", "blocks": blocks, "placements": placements},
    )
    return PurgeCounts(blocks=blocks, placements=placements)
