"""Movements API serializers: the ledger's filters and rows, and the run action's input."""

from rest_framework import serializers

from controlplane.directory.choices import TierLevel
from controlplane.movements.choices import MovementKind, MovementReason, MovementState
from controlplane.movements.models import Movement
from controlplane.movements.selectors import MOVEMENT_ORDERINGS

BIGINT_MAX = 2**63 - 1


class MovementSerializer(serializers.ModelSerializer[Movement]):
    block = serializers.IntegerField(source="block_id", read_only=True)
    route = serializers.CharField(read_only=True)

    class Meta:
        model = Movement
        fields = [
            "id",
            "plan",
            "block",
            "kind",
            "reason",
            "state",
            "route",
            "src_placement_id",
            "src_epoch",
            "src_tier",
            "src_node",
            "dst_tier",
            "dst_node",
            "dst_placement_id",
            "exec_node",
            "attempts",
            "policy_version",
            "mode",
            "bytes",
            "duration_s",
            "detail",
            "error",
            "created_at",
            "dispatched_at",
            "started_at",
            "finished_at",
        ]


class MovementListQuerySerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=MovementState.choices, required=False)
    kind = serializers.ChoiceField(choices=MovementKind.choices, required=False)
    reason = serializers.ChoiceField(choices=MovementReason.choices, required=False)
    node = serializers.SlugField(max_length=63, required=False, help_text="Node that executes the movement.")
    src_tier = serializers.ChoiceField(choices=TierLevel.choices, required=False)
    dst_tier = serializers.ChoiceField(
        choices=[*TierLevel.choices, ("", "none (evictions)")], required=False, allow_blank=True
    )
    block = serializers.IntegerField(min_value=1, max_value=BIGINT_MAX, required=False)
    plan = serializers.UUIDField(required=False)
    ordering = serializers.ChoiceField(choices=sorted(MOVEMENT_ORDERINGS), default="-id")


class RunInputSerializer(serializers.Serializer):
    node = serializers.SlugField(
        max_length=63,
        required=False,
        allow_null=True,
        default=None,
        help_text="Plan only this node's tiers (default: every up node and the remote tier).",
    )
    reason = serializers.ChoiceField(choices=MovementReason.choices, default=MovementReason.MANUAL)
    dry_run = serializers.BooleanField(default=False)


class WarmInputSerializer(serializers.Serializer):
    node = serializers.SlugField(max_length=63)
    blocks = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=BIGINT_MAX),
        required=False,
        max_length=4096,
        allow_empty=False,
    )
    namespace = serializers.SlugField(max_length=63, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=4096, default=256)
    reason = serializers.ChoiceField(choices=MovementReason.choices, default=MovementReason.SCHEDULE)
    dry_run = serializers.BooleanField(default=False)


class PlanSummarySerializer(serializers.Serializer):
    plan = serializers.UUIDField()
    policy_version = serializers.IntegerField()
    mode = serializers.CharField()
    dry_run = serializers.BooleanField()
    moves = serializers.IntegerField()
    evictions = serializers.IntegerField()
    bytes_moved = serializers.IntegerField()
    bytes_evicted = serializers.IntegerField()
    by_route = serializers.DictField(child=serializers.DictField(child=serializers.IntegerField()))
    written = serializers.IntegerField()
    tiers = serializers.ListField(child=serializers.DictField())
