"""Movements: the ledger of planned, running and finished tier moves, evictions and warm-ups,
the small tally table the metrics read, and the reconcile job's recounts of tier usage."""

from django.db import models
from django.db.models import Q

from controlplane.directory.models import Block
from controlplane.movements.choices import IN_FLIGHT, MovementKind, MovementReason, MovementState


class Movement(models.Model):
    """One planned change of where a block's bytes are, from plan to result.

    The source placement is kept by id and epoch, not as a foreign key: a finished move deletes
    its source copy, and the ledger outlives it. `src_epoch` is the epoch the planner read; the
    node's flip is refused if the copy changed since (someone else moved, evicted or quarantined
    it), so a late or duplicate execution can never win.

    Index plan: the list filters and the planner's "what is in flight out of this tier" are index
    scans; the partial unique index on block is the database's guard of one in-flight movement
    per block."""

    plan = models.UUIDField(help_text="The planning run that wrote this movement.")
    block = models.ForeignKey(
        Block, on_delete=models.DO_NOTHING, related_name="movements", db_index=False, db_constraint=False
    )
    kind = models.CharField(max_length=8, choices=MovementKind.choices)
    reason = models.CharField(max_length=16, choices=MovementReason.choices)
    state = models.CharField(max_length=12, choices=MovementState.choices, default=MovementState.PLANNED)
    src_placement_id = models.BigIntegerField(help_text="Placement (copy) the movement starts from.")
    src_epoch = models.PositiveBigIntegerField(help_text="Epoch of the source copy when it was planned.")
    src_tier = models.CharField(max_length=8)
    src_node = models.CharField(max_length=63, blank=True, help_text="Empty for the shared remote tier.")
    dst_tier = models.CharField(max_length=8, blank=True, help_text="Empty for an eviction.")
    dst_node = models.CharField(max_length=63, blank=True, help_text="Empty for remote or an eviction.")
    dst_placement_id = models.BigIntegerField(
        null=True, blank=True, help_text="The target copy the node reserved (moves and warms)."
    )
    exec_node = models.CharField(max_length=63, help_text="Node whose worker executes it (queue node.<name>).")
    attempts = models.PositiveIntegerField(default=0)
    policy_version = models.PositiveBigIntegerField(default=0)
    mode = models.CharField(max_length=63, blank=True)
    bytes = models.PositiveBigIntegerField(default=0)
    duration_s = models.FloatField(null=True, blank=True)
    detail = models.TextField(blank=True, help_text="Why it was planned, and what happened.")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField()
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["block"],
                condition=Q(state__in=[s.value for s in IN_FLIGHT]),
                name="movement_one_in_flight_per_block",
            ),
            models.CheckConstraint(
                condition=Q(kind=MovementKind.EVICT, dst_tier="") | (~Q(kind=MovementKind.EVICT) & ~Q(dst_tier="")),
                name="movement_dst_iff_not_evict",
            ),
        ]
        indexes = [
            models.Index(fields=["block", "id"], name="movement_block_idx"),
            models.Index(fields=["state", "id"], name="movement_state_idx"),
            models.Index(fields=["exec_node", "id"], name="movement_node_idx"),
            models.Index(fields=["src_tier", "dst_tier", "id"], name="movement_route_idx"),
            models.Index(fields=["reason", "id"], name="movement_reason_idx"),
            models.Index(fields=["kind", "id"], name="movement_kind_idx"),
            # What is already leaving a node's tier: the planner subtracts it from the tier's use.
            models.Index(
                fields=["src_node", "src_tier"],
                condition=Q(state__in=[s.value for s in IN_FLIGHT]),
                name="movement_in_flight_src_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.block_id} {self.src_tier}->{self.dst_tier or 'gone'} ({self.state})"

    @property
    def route(self) -> str:
        return f"{self.src_tier}->{self.dst_tier or 'evicted'}"


class MovementTally(models.Model):
    """Running totals per (kind, route, reason, result), upserted in the transaction that finishes
    a movement, so /metrics reads a few dozen rows instead of counting the ledger."""

    kind = models.CharField(max_length=8)
    src_tier = models.CharField(max_length=8)
    dst_tier = models.CharField(max_length=8, blank=True)
    reason = models.CharField(max_length=16, blank=True)
    result = models.CharField(max_length=12)
    blocks = models.PositiveBigIntegerField(default=0)
    bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["kind", "src_tier", "dst_tier", "reason", "result"]
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "src_tier", "dst_tier", "reason", "result"], name="movementtally_labels_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.src_tier}->{self.dst_tier} {self.reason} {self.result}: {self.blocks}"


class TierRecount(models.Model):
    """The last recount of one tier's usage counters by the reconcile job, and how many of the
    recounts so far found them off and corrected them. `node` is blank for the shared remote
    tier (recounted by one node or another, in turn)."""

    node = models.CharField(max_length=63, blank=True)
    tier = models.CharField(max_length=8)
    drift_bytes = models.BigIntegerField(
        help_text="Counted minus held at the last recount (positive: bytes counted that were not there)."
    )
    drift_blocks = models.BigIntegerField(help_text="Counted minus held blocks at the last recount.")
    corrections = models.PositiveBigIntegerField(default=0, help_text="Recounts that found a drift and corrected it.")
    corrected_bytes = models.PositiveBigIntegerField(default=0, help_text="Sum of the drifts corrected, in bytes.")
    recounted_at = models.DateTimeField()

    class Meta:
        ordering = ["tier", "node"]
        constraints = [
            models.UniqueConstraint(fields=["node", "tier"], name="tierrecount_node_tier_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.tier}@{self.node or 'shared'}: drift {self.drift_bytes} bytes"
