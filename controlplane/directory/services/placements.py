"""Directory writes about copies: the placement lifecycle (pending, ready, flipped, corrupt,
deleting, deleted), each step guarded by the copy's epoch, one by one and in bulk."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from controlplane.directory import queries
from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.errors import (
    DirectoryError,
    InvalidTransition,
    PlacementNotFound,
    StaleEpoch,
    UnknownNode,
)
from controlplane.directory.models import Block, Node, Placement
from controlplane.directory.registrations import placement_changes_write
from controlplane.directory.selectors import sql_cursor
from worker.dataplane.directory import PlacementChange


def _node_for(tier: str, node: str | None) -> Node | None:
    if tier not in TierLevel.values:
        raise DirectoryError(
            f"tier: unknown tier {tier!r}; expected one of {', '.join(TierLevel.values)}", field="tier"
        )
    if tier == TierLevel.REMOTE:
        if node:
            raise DirectoryError("node: a remote placement belongs to no node", field="node")
        return None
    if not node:
        raise DirectoryError(f"node: a {tier} placement needs the node that holds it", field="node")
    found = Node.objects.filter(name=node).first()
    if found is None:
        raise UnknownNode(f"node: no node named {node!r}")
    return found


def _locked(placement_id: int, epoch: int | None, allowed: Sequence[str], change: str) -> Placement:
    placement = Placement.objects.select_for_update().filter(id=placement_id).first()
    if placement is None:
        raise PlacementNotFound(f"placement: no placement {placement_id}")
    _check(placement, epoch, allowed, change)
    return placement


def _check(placement: Placement, epoch: int | None, allowed: Sequence[str], change: str) -> None:
    if epoch is not None and placement.epoch != epoch:
        raise StaleEpoch(placement_id=placement.id, expected=epoch, actual=placement.epoch)
    if placement.state not in allowed:
        raise InvalidTransition(
            f"state: placement {placement.id} is {placement.state}; {change} needs {' or '.join(allowed)}"
        )


def _advance(placement: Placement, state: str, now: datetime, **fields: Any) -> Placement:
    placement.state = state
    placement.epoch += 1
    placement.updated_at = now
    for name, value in fields.items():
        setattr(placement, name, value)
    placement.save(update_fields=["state", "epoch", "updated_at", *fields])
    return placement


@transaction.atomic
def placement_create_pending(
    *,
    block_id: int,
    tier: str,
    node: str | None,
    size_bytes: int,
    locator: str = "",
    offset: int = 0,
    now: datetime | None = None,
) -> Placement:
    """Reserve a copy of a block in a tier before its bytes are written (a movement's target).
    A previous corrupt or deleting copy in the same place is reused with a new epoch."""
    if size_bytes < 0 or offset < 0:
        raise DirectoryError(
            "size_bytes: cannot be negative" if size_bytes < 0 else "offset: cannot be negative",
            field="size_bytes" if size_bytes < 0 else "offset",
        )
    node_row = _node_for(tier, node)
    if not Block.objects.filter(id=block_id).exists():
        raise DirectoryError(f"block: no block {block_id}", field="block")
    now = now or timezone.now()
    placement = Placement.objects.select_for_update().filter(block_id=block_id, tier=tier, node=node_row).first()
    if placement is None:
        try:
            with transaction.atomic():
                return Placement.objects.create(
                    block_id=block_id,
                    tier=tier,
                    node=node_row,
                    locator=locator,
                    offset=offset,
                    size_bytes=size_bytes,
                    checksum="",
                    state=PlacementState.PENDING,
                    epoch=1,
                    updated_at=now,
                )
        except IntegrityError:
            # Another process reserved the same copy between our read and our insert.
            placement = Placement.objects.select_for_update().get(block_id=block_id, tier=tier, node=node_row)
    _check(placement, None, [PlacementState.CORRUPT, PlacementState.DELETING], "a new pending copy")
    return _advance(
        placement, PlacementState.PENDING, now, locator=locator, offset=offset, size_bytes=size_bytes, checksum=""
    )


@transaction.atomic
def placement_mark_ready(
    *, placement_id: int, epoch: int, checksum: str, size_bytes: int | None = None, now: datetime | None = None
) -> Placement:
    """A pending copy whose bytes are written and verified becomes servable."""
    _check_checksum(checksum)
    placement = _locked(placement_id, epoch, [PlacementState.PENDING], "mark ready")
    fields: dict[str, Any] = {"checksum": checksum}
    if size_bytes is not None:
        fields["size_bytes"] = size_bytes
    return _advance(placement, PlacementState.READY, now or timezone.now(), **fields)


@transaction.atomic
def placement_flip(
    *, source_id: int, source_epoch: int, target_id: int, target_epoch: int, checksum: str, now: datetime | None = None
) -> tuple[Placement, Placement]:
    """The end of a move, in one transaction: the written target becomes READY and the source
    DELETING. Both epochs must be the ones the mover read; otherwise nothing changes (StaleEpoch)."""
    if source_id == target_id:
        raise DirectoryError("target_id: the target must differ from the source", field="target_id")
    _check_checksum(checksum)
    # Lock in id order so two flips over the same pair cannot deadlock.
    locked = {
        p.id: p for p in Placement.objects.select_for_update().filter(id__in=[source_id, target_id]).order_by("id")
    }
    for ident in (source_id, target_id):
        if ident not in locked:
            raise PlacementNotFound(f"placement: no placement {ident}")
    source, target = locked[source_id], locked[target_id]
    if source.block_id != target.block_id:
        raise DirectoryError("target_id: source and target are copies of different blocks", field="target_id")
    _check(source, source_epoch, [PlacementState.READY], "flip (source)")
    _check(target, target_epoch, [PlacementState.PENDING], "flip (target)")
    now = now or timezone.now()
    target = _advance(target, PlacementState.READY, now, checksum=checksum)
    source = _advance(source, PlacementState.DELETING, now)
    return source, target


@dataclasses.dataclass(frozen=True)
class PlacementFlip:
    """One verified copy made servable by `placements_flip_many`: the target (PENDING at
    `target_epoch`) becomes READY with `checksum`; with a source (READY at `source_epoch`), a move,
    that source becomes DELETING in the same step; without one, a warm-up, the source stays."""

    target_id: int
    target_epoch: int
    checksum: str
    source_id: int | None = None
    source_epoch: int | None = None


@transaction.atomic
def placements_flip_many(*, flips: Sequence[PlacementFlip], now: datetime | None = None) -> list[DirectoryError | None]:
    """`placement_flip` (or, without a source, `placement_mark_ready`) for many copies at once: one
    locking read and one update for all of them, so a node's batch of moves costs two statements
    instead of a savepoint and two statements per copy. Each flip is checked against the epochs
    as its single form would be, in order; a refused one changes nothing and is returned as its
    error (None for a flip done), the others go on. Malformed input refuses the whole call."""
    for i, flip in enumerate(flips):
        try:
            _check_checksum(flip.checksum)
        except DirectoryError as exc:
            raise DirectoryError(f"flips[{i}].{exc}", field=f"flips[{i}].checksum") from None
        if flip.source_id is not None and flip.source_id == flip.target_id:
            raise DirectoryError(
                f"flips[{i}].target_id: the target must differ from the source", field=f"flips[{i}].target_id"
            )
        if (flip.source_id is None) != (flip.source_epoch is None):
            raise DirectoryError(
                f"flips[{i}].source_epoch: a source needs its epoch and an epoch its source",
                field=f"flips[{i}].source_epoch",
            )
    ids = {flip.target_id for flip in flips} | {flip.source_id for flip in flips if flip.source_id is not None}
    # Lock in id order, as placement_flip does, so concurrent flips cannot deadlock.
    locked = {p.id: p for p in Placement.objects.select_for_update().filter(id__in=sorted(ids)).order_by("id")}
    now = now or timezone.now()
    outcomes: list[DirectoryError | None] = []
    changed: dict[int, Placement] = {}
    for flip in flips:
        try:
            target = locked.get(flip.target_id)
            if target is None:
                raise PlacementNotFound(f"placement: no placement {flip.target_id}")
            source = None
            if flip.source_id is not None:
                source = locked.get(flip.source_id)
                if source is None:
                    raise PlacementNotFound(f"placement: no placement {flip.source_id}")
                if source.block_id != target.block_id:
                    raise DirectoryError(
                        "target_id: source and target are copies of different blocks", field="target_id"
                    )
                _check(source, flip.source_epoch, [PlacementState.READY], "flip (source)")
                _check(target, flip.target_epoch, [PlacementState.PENDING], "flip (target)")
            else:
                _check(target, flip.target_epoch, [PlacementState.PENDING], "mark ready")
        except DirectoryError as exc:
            outcomes.append(exc)
            continue
        for placement, state in ((target, PlacementState.READY), (source, PlacementState.DELETING)):
            if placement is not None:
                placement.state, placement.epoch, placement.updated_at = state, placement.epoch + 1, now
                changed[placement.id] = placement
        target.checksum = flip.checksum
        outcomes.append(None)
    if changed:
        Placement.objects.bulk_update(list(changed.values()), ["state", "epoch", "updated_at", "checksum"])
    return outcomes


@dataclasses.dataclass(frozen=True)
class PendingCopy:
    """One copy `placements_create_pending_many` reserves, as `placement_create_pending` takes it."""

    block_id: int
    tier: str
    node: str | None
    size_bytes: int


_PLACEMENT_COLUMNS = ", ".join(f'p."{f.column}"' for f in Placement._meta.concrete_fields)

# Rows go in (block, tier, node) order, so two reservations over the same copies queue behind each
# other instead of deadlocking. A copy that exists is reused only from CORRUPT or DELETING, with a
# new epoch, as placement_create_pending does; any other state leaves it alone (not returned).
_CREATE_PENDING_SQL = f"""
INSERT INTO {queries.PLACEMENT_TABLE} AS p (block_id, tier, node_id, locator, "offset", size_bytes, checksum,
                                            state, epoch, updated_at)
SELECT b.id, r.tier, r.node_id, '', 0, r.size_bytes, '', '{PlacementState.PENDING.value}', 1, %(now)s
FROM unnest(%(block_ids)s::bigint[], %(tiers)s::text[], %(node_ids)s::bigint[], %(sizes)s::bigint[])
     AS r(block_id, tier, node_id, size_bytes)
JOIN {queries.BLOCK_TABLE} b ON b.id = r.block_id
ORDER BY b.id, r.tier, r.node_id
ON CONFLICT (block_id, tier, node_id) DO UPDATE
SET locator = '', "offset" = 0, size_bytes = EXCLUDED.size_bytes, checksum = '', state = EXCLUDED.state,
    epoch = p.epoch + 1, updated_at = EXCLUDED.updated_at
WHERE p.state IN ('{PlacementState.CORRUPT.value}', '{PlacementState.DELETING.value}')
RETURNING {_PLACEMENT_COLUMNS}
"""


def placements_create_pending_many(
    *, copies: Sequence[PendingCopy], now: datetime | None = None
) -> list[Placement | DirectoryError]:
    """`placement_create_pending` for many copies at once: one statement reserves all of them (a
    node's wave of movement targets), instead of six statements and two savepoints per copy. Each
    copy is judged as its single form would judge it: the reserved copy comes back at its new
    epoch, a copy that cannot be reserved as its error (InvalidTransition: a copy exists there and
    is not corrupt or deleting; DirectoryError: the block is gone), and the others go on. Malformed
    input (an unknown tier or node, a copy named twice) refuses the whole call before it writes.

    Like every bulk service of a node's wave it takes no savepoint of its own inside the caller's
    transaction (two round trips per wave): a refusal comes before anything is written, so it
    leaves that transaction usable; a database error fails it, as it would fail any statement."""
    node_names = {copy.node for copy in copies if copy.node}
    node_ids = dict(Node.objects.filter(name__in=node_names).values_list("name", "id")) if node_names else {}
    seen: set[tuple[int, str, str | None]] = set()
    for i, copy in enumerate(copies):
        try:
            if copy.size_bytes < 0:
                raise DirectoryError("size_bytes: cannot be negative", field="size_bytes")
            if copy.tier not in TierLevel.values:
                raise DirectoryError(
                    f"tier: unknown tier {copy.tier!r}; expected one of {', '.join(TierLevel.values)}", field="tier"
                )
            if (copy.tier == TierLevel.REMOTE) != (not copy.node):
                raise DirectoryError(
                    "node: a remote placement belongs to no node"
                    if copy.node
                    else f"node: a {copy.tier} placement needs the node that holds it",
                    field="node",
                )
            if copy.node and copy.node not in node_ids:
                raise UnknownNode(f"node: no node named {copy.node!r}")
            if (copy.block_id, copy.tier, copy.node) in seen:
                raise DirectoryError("block_id: the same copy is named twice", field="block_id")
        except DirectoryError as exc:
            raise DirectoryError(f"copies[{i}].{exc}", field=f"copies[{i}].{exc.field}") from None
        seen.add((copy.block_id, copy.tier, copy.node))
    if not copies:
        return []
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(
            _CREATE_PENDING_SQL,
            {
                "now": now,
                "block_ids": queries.ints(c.block_id for c in copies),
                "tiers": queries.texts(c.tier for c in copies),
                "node_ids": queries.ints(node_ids[c.node] if c.node else None for c in copies),
                "sizes": queries.ints(c.size_bytes for c in copies),
            },
        )
        names = [f.attname for f in Placement._meta.concrete_fields]
        reserved = {
            (p.block_id, p.tier, p.node_id): p
            for p in (Placement.from_db(connection.alias, names, row) for row in cursor.fetchall())
        }
        keys = [(c.block_id, c.tier, node_ids[c.node] if c.node else None) for c in copies]
        refused = [key for key in keys if key not in reserved]
        why = _why_not_pending(refused) if refused else {}
    return [reserved.get(key) or why[key] for key in keys]


def _why_not_pending(keys: Sequence[tuple[int, str, int | None]]) -> dict[tuple[int, str, int | None], DirectoryError]:
    """Why `placements_create_pending_many` reserved none of these copies (block gone, or a copy
    there in a state a new pending copy cannot start from); read after the insert, in its transaction."""
    block_ids = {block_id for block_id, _, _ in keys}
    existing = set(Block.objects.filter(id__in=block_ids).values_list("id", flat=True))
    copies = {(p.block_id, p.tier, p.node_id): p for p in Placement.objects.filter(block_id__in=block_ids)}
    why: dict[tuple[int, str, int | None], DirectoryError] = {}
    for key in keys:
        placement = copies.get(key)
        if key[0] not in existing:
            why[key] = DirectoryError(f"block: no block {key[0]}", field="block")
        elif placement is None:  # removed again between the insert and this read
            why[key] = InvalidTransition(f"state: the copy of block {key[0]} in {key[1]} changed meanwhile")
        else:
            why[key] = InvalidTransition(
                f"state: placement {placement.id} is {placement.state}; a new pending copy "
                f"needs {PlacementState.CORRUPT} or {PlacementState.DELETING}"
            )
    return why


_DELETE_MANY_SQL = f"""
WITH doomed AS (
    SELECT p.id FROM {queries.PLACEMENT_TABLE} p
    JOIN unnest(%(ids)s::bigint[], %(epochs)s::bigint[]) AS r(id, epoch) ON p.id = r.id AND p.epoch = r.epoch
    WHERE p.state IN ('{PlacementState.DELETING.value}', '{PlacementState.CORRUPT.value}')
    ORDER BY p.id
    FOR UPDATE OF p
)
DELETE FROM {queries.PLACEMENT_TABLE} p USING doomed WHERE p.id = doomed.id
RETURNING p.id
"""


@transaction.atomic(savepoint=False)  # no savepoint of its own, as placements_create_pending_many
def placements_delete_many(*, placements: Sequence[tuple[int, int]]) -> set[int]:
    """`placement_delete` for many copies whose bytes are freed, given as (placement id, epoch):
    one statement, rows locked in id order. A copy that is not DELETING or CORRUPT at its epoch any
    more (re-registered or already forgotten meanwhile) is left alone. Returns the ids deleted."""
    if not placements:
        return set()
    with connection.cursor() as cursor:
        cursor.execute(
            _DELETE_MANY_SQL,
            {"ids": queries.ints(i for i, _ in placements), "epochs": queries.ints(e for _, e in placements)},
        )
        return {row[0] for row in cursor.fetchall()}


@transaction.atomic
def placement_mark_corrupt(*, placement_id: int, epoch: int | None = None, now: datetime | None = None) -> Placement:
    """A copy that failed verification is quarantined: never served again. Without `epoch` the
    mark applies whatever happened since (a bad checksum is a fact, not a race)."""
    placement = _locked(
        placement_id, epoch, [PlacementState.PENDING, PlacementState.READY, PlacementState.DELETING], "mark corrupt"
    )
    return _advance(placement, PlacementState.CORRUPT, now or timezone.now())


@transaction.atomic
def placement_mark_deleting(*, placement_id: int, epoch: int, now: datetime | None = None) -> Placement:
    """A copy about to be freed stops being served first."""
    placement = _locked(
        placement_id, epoch, [PlacementState.PENDING, PlacementState.READY, PlacementState.CORRUPT], "mark deleting"
    )
    return _advance(placement, PlacementState.DELETING, now or timezone.now())


@transaction.atomic
def placement_delete(*, placement_id: int, epoch: int) -> None:
    """Forget a copy whose bytes are freed (it must be DELETING or CORRUPT at `epoch`)."""
    placement = _locked(placement_id, epoch, [PlacementState.DELETING, PlacementState.CORRUPT], "delete")
    placement.delete()


@transaction.atomic
def placements_change(*, changes: Sequence[PlacementChange], now: datetime | None = None) -> int:
    """Apply by-key changes in order (consecutive changes of one kind in one statement); changes
    whose copy is missing or whose epoch moved on are skipped. Returns how many copies changed."""
    with sql_cursor() as cursor:
        return placement_changes_write(cursor, changes=changes, now=now or timezone.now())


def _check_checksum(checksum: str) -> None:
    if checksum and (len(checksum) != 32 or any(c not in "0123456789abcdef" for c in checksum)):
        raise DirectoryError("checksum: expected 32 lower-case hex characters (xxh3-128)", field="checksum")
