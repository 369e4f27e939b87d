"""The node's one door into the control plane: every read and write a node makes of the control
plane's data, and the names (states, tiers, errors) it needs to judge the answers.

The node side (`worker`, outside the data plane) imports from the control plane only this module
and its runtime glue (`controlplane.celery_app`, `controlplane.runtime`); the import contracts in
pyproject.toml hold it to that. Nothing here hands the node a model instance: the rows a node
reads come back as the plain records below (`MovementRecord`, `CopyRecord`, `BlockRecord`,
`HeldCopy`), so the models and their queries can change without the node noticing.

What is here, by caller:
- the movement executor (`worker.movement_executor`): start and finish movements, read their
  blocks and copies, reserve, flip, mark and free copies under the directory's epoch fencing,
  list a node's copies and the keys the directory knows, count checksum failures and recounts;
- the directory client (`worker.postgres_directory`): lookups, salts, registrations, placement
  changes and touches over the node's own psycopg connections (the SQL of
  `controlplane.directory.queries` and `registrations`), and the dashboard's registered-block event;
- the node runtime (`worker.node`, `worker.vllm_connector`, `strata_node`): model profile and
  namespace records, the heartbeat, marking the node down, the policies in force, the broker
  options of the node's Redis user, and the check of the node's database credential.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from controlplane.directory.choices import PlacementState, TierLevel
from controlplane.directory.errors import DirectoryError, InvalidTransition, PlacementNotFound, StaleEpoch
from controlplane.directory.models import Block, Node, Placement
from controlplane.directory.queries import LookupAnswer, TouchRow, lookup_result, namespace_salt, shared_salts
from controlplane.directory.queries import lookup as directory_lookup
from controlplane.directory.queries import touch as touches_write
from controlplane.directory.registrations import RegistrationsWritten, placement_changes_write, registrations_write
from controlplane.directory.services import (
    PendingCopy,
    PlacementFlip,
    TierReport,
    blocks_registered_announce,
    node_mark_down,
    placement_delete,
    placements_delete_many,
    placements_flip_many,
)
from controlplane.directory.services import modelprofile_ensure as _modelprofile_ensure
from controlplane.directory.services import namespace_ensure as _namespace_ensure
from controlplane.directory.services import node_heartbeat as _node_heartbeat
from controlplane.directory.services import placement_mark_corrupt as _placement_mark_corrupt
from controlplane.directory.services import placement_mark_deleting as _placement_mark_deleting
from controlplane.directory.services import placements_create_pending_many as _placements_create_pending_many
from controlplane.directory.services.credentials import credential_too_strong
from controlplane.directory.services.redis_identity import node_broker_transport_options
from controlplane.movements.choices import MovementKind, MovementState
from controlplane.movements.errors import MovementError
from controlplane.movements.models import Movement
from controlplane.movements.services import (
    MovementResult,
    checksum_failures_count,
    movements_finished_announce,
    movements_set_targets,
    tier_recount_record,
)
from controlplane.movements.services import movements_finish_many as _movements_finish_many
from controlplane.movements.services import movements_start_many as _movements_start_many
from controlplane.policies.dispatch import node_policies
from controlplane.policies.snapshot import policies_snapshot
from worker.dataplane.traffic import TrafficSummary

__all__ = [
    "BlockRecord",
    "CopyRecord",
    "DirectoryError",
    "HeldCopy",
    "InvalidTransition",
    "LookupAnswer",
    "MovementError",
    "MovementKind",
    "MovementRecord",
    "MovementResult",
    "MovementState",
    "PendingCopy",
    "PlacementFlip",
    "PlacementNotFound",
    "PlacementState",
    "RegistrationsWritten",
    "StaleEpoch",
    "TierLevel",
    "TierReport",
    "TouchRow",
    "block_get",
    "blocks_by_id",
    "blocks_registered_announce",
    "checksum_failures_count",
    "copies_by_id",
    "copy_get",
    "credential_too_strong",
    "directory_lookup",
    "lookup_result",
    "modelprofile_ensure",
    "movement_start",
    "movements_finish_many",
    "movements_finished_announce",
    "movements_set_targets",
    "movements_start_many",
    "namespace_ensure",
    "namespace_salt",
    "node_broker_transport_options",
    "node_copies",
    "node_heartbeat",
    "node_keys_known",
    "node_mark_down",
    "placement_changes_write",
    "placement_delete",
    "placement_mark_corrupt",
    "placement_mark_deleting",
    "placements_create_pending_many",
    "placements_delete_many",
    "placements_flip_many",
    "policies_in_force",
    "registrations_write",
    "shared_salts",
    "tier_recount_record",
    "touches_write",
]


# -- records: the rows a node reads, as plain data ---------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class BlockRecord:
    """A block as a node needs it: which bytes (its prefix key) and how many."""

    id: int
    prefix_key: uuid.UUID
    size_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class CopyRecord:
    """A placement (one copy of a block in one tier), as the directory held it when read."""

    id: int
    block_id: int
    tier: str
    state: str
    epoch: int
    size_bytes: int
    checksum: str


@dataclasses.dataclass(frozen=True, slots=True)
class HeldCopy:
    """A copy a node holds, with its block (what `node_copies` lists)."""

    copy: CopyRecord
    block: BlockRecord


@dataclasses.dataclass(slots=True)
class MovementRecord:
    """A movement of the ledger as a node executes it. `dst_placement_id` is the one field the
    node sets itself: the target copy it reserved (also recorded with `movements_set_targets`)."""

    id: int
    kind: str
    state: str
    block_id: int
    src_placement_id: int
    src_epoch: int
    src_tier: str
    src_node: str
    dst_tier: str
    dst_node: str
    dst_placement_id: int | None
    exec_node: str
    attempts: int
    bytes: int
    duration_s: float | None

    @property
    def route(self) -> str:
        return f"{self.src_tier}->{self.dst_tier or 'evicted'}"


def _block(block: Block) -> BlockRecord:
    return BlockRecord(id=block.id, prefix_key=block.prefix_key, size_bytes=block.size_bytes)


def _copy(placement: Placement) -> CopyRecord:
    return CopyRecord(
        id=placement.id,
        block_id=placement.block_id,
        tier=placement.tier,
        state=placement.state,
        epoch=placement.epoch,
        size_bytes=placement.size_bytes,
        checksum=placement.checksum,
    )


def _movement(movement: Movement) -> MovementRecord:
    return MovementRecord(
        id=movement.id,
        kind=movement.kind,
        state=movement.state,
        block_id=movement.block_id,
        src_placement_id=movement.src_placement_id,
        src_epoch=movement.src_epoch,
        src_tier=movement.src_tier,
        src_node=movement.src_node,
        dst_tier=movement.dst_tier,
        dst_node=movement.dst_node,
        dst_placement_id=movement.dst_placement_id,
        exec_node=movement.exec_node,
        attempts=movement.attempts,
        bytes=movement.bytes,
        duration_s=movement.duration_s,
    )


# -- movements ---------------------------------------------------------------------------------------
def movement_start(*, movement_id: int, node: str) -> MovementRecord | None:
    """The node begins (or resumes) a movement; None when it finished already or does not exist
    (`controlplane.movements.services.movement_start`)."""
    return movements_start_many(movement_ids=[movement_id], node=node)[0]


def movements_start_many(*, movement_ids: Sequence[int], node: str) -> list[MovementRecord | None]:
    """`movement_start` for a wave, in the order given (one locking read, one update; inside the
    caller's transaction without a savepoint of its own). MovementError for another node's movement."""
    return [None if m is None else _movement(m) for m in _movements_start_many(movement_ids=movement_ids, node=node)]


def movements_finish_many(*, results: Sequence[MovementResult]) -> list[MovementRecord | None]:
    """Record a wave's results in the ledger and the tallies; each movement as finished, None for
    one another attempt finished meanwhile."""
    return [None if m is None else _movement(m) for m in _movements_finish_many(results=results)]


# -- blocks and copies -------------------------------------------------------------------------------
def block_get(block_id: int) -> BlockRecord | None:
    """A block, None once it was purged."""
    block = Block.objects.filter(id=block_id).only("id", "prefix_key", "size_bytes").first()
    return None if block is None else _block(block)


def blocks_by_id(block_ids: Sequence[int]) -> dict[int, BlockRecord]:
    """The blocks of `block_ids` that exist, by id (one statement)."""
    found = Block.objects.only("id", "prefix_key", "size_bytes").in_bulk(list(block_ids))
    return {ident: _block(block) for ident, block in found.items()}


def copy_get(placement_id: int) -> CopyRecord | None:
    """A copy as the directory holds it now, None once it is gone."""
    placement = Placement.objects.filter(id=placement_id).first()
    return None if placement is None else _copy(placement)


def copies_by_id(placement_ids: Sequence[int]) -> dict[int, CopyRecord]:
    """The copies of `placement_ids` that exist, by id (one statement)."""
    return {ident: _copy(p) for ident, p in Placement.objects.in_bulk(list(placement_ids)).items()}


def placement_mark_corrupt(*, placement_id: int, epoch: int | None = None) -> None:
    """Mark a copy CORRUPT so it is never served again (guarded by `epoch` when given; StaleEpoch,
    InvalidTransition, PlacementNotFound when it changed)."""
    _placement_mark_corrupt(placement_id=placement_id, epoch=epoch)


def placement_mark_deleting(*, placement_id: int, epoch: int) -> CopyRecord:
    """Mark a copy DELETING, guarded by its epoch (StaleEpoch, InvalidTransition, PlacementNotFound
    when it changed); the copy as marked, at its next epoch."""
    return _copy(_placement_mark_deleting(placement_id=placement_id, epoch=epoch))


def placements_create_pending_many(*, copies: Sequence[PendingCopy]) -> list[CopyRecord | DirectoryError]:
    """Reserve PENDING copies, each with a fresh epoch, in one statement: per copy, the reserved
    copy or the DirectoryError that refused it (InvalidTransition: the destination holds one)."""
    return [
        _copy(answer) if isinstance(answer, Placement) else answer
        for answer in _placements_create_pending_many(copies=copies)
    ]


def node_copies(
    node: str, tier: str, *, batch: int, states: Sequence[str] = (PlacementState.READY,)
) -> Iterator[list[HeldCopy]]:
    """`node`'s copies in `tier` (the shared ones for remote) in `states`, with their blocks, in
    id-ordered batches of `batch`; nothing for a node the directory does not know."""
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
        yield [HeldCopy(copy=_copy(p), block=_block(p.block)) for p in found]


def node_keys_known(node: str, tier: str, keys: set[uuid.UUID]) -> set[uuid.UUID]:
    """Which of `keys` (prefix keys) have a copy of any state in `node`'s `tier` (the shared
    copies for remote)."""
    if not keys:
        return set()
    ordered = sorted(keys)
    found: set[uuid.UUID] = set()
    for start in range(0, len(ordered), 1000):  # the prefix-key index serves each IN list
        rows = Placement.objects.filter(tier=tier, block__prefix_key__in=ordered[start : start + 1000])
        rows = rows.filter(node__isnull=True) if tier == TierLevel.REMOTE else rows.filter(node__name=node)
        found.update(rows.values_list("block__prefix_key", flat=True))
    return found


# -- the node runtime ----------------------------------------------------------------------------------
def policies_in_force() -> tuple[int, dict[str, list[dict[str, object]]]]:
    """The version of the policies in force and what a node enforces of them (classes, tier
    rules, quotas), as `node.apply_policies` carries them."""
    snapshot = policies_snapshot()
    return snapshot.version, node_policies(snapshot)


def modelprofile_ensure(*, profile: Any) -> None:
    """Record the model profile of a data-plane profile (`worker.dataplane.profile.ModelProfile`)
    unless the directory has one of that layout: registrations of its blocks name it."""
    _modelprofile_ensure(profile=profile)


def namespace_ensure(*, name: str) -> None:
    """Create the namespace `name` (with a fresh salt) unless it exists."""
    _namespace_ensure(name=name)


def node_heartbeat(
    *,
    name: str,
    host: str,
    address: str = "",
    pid: int | None = None,
    version: str = "",
    heartbeat_seconds: float,
    tiers: list[TierReport],
    group: str | None = None,
    engine: str = "strata",
    engine_address: str = "",
    traffic: TrafficSummary | None = None,
) -> None:
    """Report the node, its tiers and its recent traffic (one transaction, stamped with the
    database's clock); a stale node comes back up."""
    _node_heartbeat(
        name=name,
        host=host,
        address=address,
        pid=pid,
        version=version,
        heartbeat_seconds=heartbeat_seconds,
        tiers=tiers,
        group=group,
        engine=engine,
        engine_address=engine_address,
        traffic=traffic,
    )
