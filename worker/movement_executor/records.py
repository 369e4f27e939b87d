"""What the executor carries between its steps: a checked movement, a reserved copy, an outcome."""

from __future__ import annotations

import dataclasses
import uuid
from concurrent.futures import Future

from controlplane.node_api import BlockRecord, CopyRecord, MovementRecord
from worker.dataplane.mover import CopyJob, CopyResult


@dataclasses.dataclass(frozen=True)
class Reservation:
    """A started movement whose source checked out: its target copy is still to be reserved."""

    movement: MovementRecord
    block: BlockRecord
    source: CopyRecord
    previous: CopyRecord | None
    """The target an earlier attempt of this movement reserved (taken over if still pending)."""
    free_source: bool
    started: float


@dataclasses.dataclass
class ReservedCopy:
    """One move or warm-up of a batch, from its reserved target to its flip: the mover's future
    result, then what the conclusion turns into directory changes."""

    movement: MovementRecord
    block: BlockRecord
    key: uuid.UUID
    source: CopyRecord
    target: CopyRecord
    free_source: bool
    started: float
    copying: Future[CopyResult] | None = None
    result: CopyResult | None = None

    @property
    def job(self) -> CopyJob:
        return CopyJob(
            source=self.movement.src_tier,
            target=self.movement.dst_tier,
            key=self.key,
            expected=self.source.checksum or "",
            size=self.block.size_bytes,
        )


@dataclasses.dataclass(frozen=True)
class Outcome:
    movement_id: int
    state: str
    """The movement's state after this run (`skipped` when it had finished before)."""
    detail: str = ""
