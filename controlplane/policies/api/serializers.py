"""Policies API serializers: inputs are checked for shape and type here; the policy rules (ranges,
watermark order, share totals, cron) are the services' and name the field they are about."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.directory.choices import TierLevel
from controlplane.policies.choices import Algorithm, ModeKind, QuotaTier
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    NamespaceQuota,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)

COMMENT_HELP = "Why the change is made; recorded with the new policy version (a summary when empty)."


def _comment() -> serializers.CharField:
    return serializers.CharField(max_length=255, allow_blank=True, required=False, default="", help_text=COMMENT_HELP)


# -- priority classes ------------------------------------------------------------------------------


class PriorityClassSerializer(serializers.ModelSerializer[PriorityClass]):
    class Meta:
        model = PriorityClass
        fields = ["name", "weight", "device_share", "namespaces", "remote_write", "updated_at"]


class PriorityClassCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=63)
    weight = serializers.FloatField(default=1.0, help_text="Greater than 0; lower-weight classes' blocks leave first.")
    device_share = serializers.FloatField(
        help_text="Largest fraction (0..1) of a node's device tier this class's blocks may hold; all classes "
        "together at most 1."
    )
    namespaces = serializers.ListField(
        child=serializers.CharField(max_length=63),
        default=list,
        help_text="Namespaces whose blocks belong to this class.",
    )
    remote_write = serializers.CharField(
        default="on-demotion",
        help_text="When the class's blocks reach L3: on-demotion (by the planner) or write-through (at write-back).",
    )
    comment = _comment()


class PriorityClassUpdateSerializer(serializers.Serializer):
    weight = serializers.FloatField(required=False)
    device_share = serializers.FloatField(required=False)
    namespaces = serializers.ListField(child=serializers.CharField(max_length=63), required=False)
    remote_write = serializers.CharField(required=False)
    comment = _comment()


# -- tier policies ---------------------------------------------------------------------------------


class TierPolicySerializer(serializers.ModelSerializer[TierPolicy]):
    demote_tier = serializers.CharField(
        read_only=True, help_text="Where leaving blocks go; empty: the next slower tier."
    )

    class Meta:
        model = TierPolicy
        fields = [
            "id",
            "tier",
            "node_group",
            "capacity_bytes",
            "capacity_fraction",
            "high_watermark",
            "low_watermark",
            "algorithm",
            "ttl_seconds",
            "min_accesses",
            "demote_tier",
            "updated_at",
        ]


class TierPolicyUpdateSerializer(serializers.Serializer):
    capacity_bytes = serializers.IntegerField(
        required=False, allow_null=True, help_text="Cap on the tier in bytes; null: what the node reports."
    )
    capacity_fraction = serializers.FloatField(
        required=False, help_text="Share (0..1] of the capacity the cache may fill."
    )
    high_watermark = serializers.FloatField(required=False, help_text="(0..1]; above it blocks leave the tier.")
    low_watermark = serializers.FloatField(
        required=False, help_text="(0..1), below the high watermark; blocks leave down to it."
    )
    algorithm = serializers.ChoiceField(choices=Algorithm.choices, required=False)
    ttl_seconds = serializers.IntegerField(
        required=False, allow_null=True, help_text="Blocks idle this long leave the tier; null: never by age."
    )
    min_accesses = serializers.IntegerField(
        required=False, help_text="Blocks with fewer accesses leave before the others."
    )
    # Text rather than a choice: the tier enumeration keeps one name in the schema (`tier`).
    demote_tier = serializers.CharField(
        max_length=8,
        required=False,
        allow_blank=True,
        help_text="Where leaving blocks go (host, disk or remote, slower than the tier); empty: the next slower tier.",
    )
    comment = _comment()


class TierPolicyCreateSerializer(TierPolicyUpdateSerializer):
    tier = serializers.ChoiceField(choices=TierLevel.choices)
    node_group = serializers.CharField(
        max_length=63, allow_blank=True, default="", help_text="Empty: every node; otherwise the nodes of this group."
    )


# -- namespace quotas ------------------------------------------------------------------------------


@extend_schema_field(
    {
        "type": "string",
        "pattern": "^(" + "|".join(QuotaTier.values) + ")$",
        "description": "One of: " + ", ".join(QuotaTier.values) + " (host and disk: per node; remote: the fleet).",
    }
)
class QuotaTierField(serializers.CharField):
    """A quota's tier. Text with a pattern in the schema: the tier enumeration keeps one name there
    (`tier`), and the service names an unknown tier in its own words."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(max_length=8, **kwargs)


class NamespaceQuotaSerializer(serializers.ModelSerializer[NamespaceQuota]):
    tier = QuotaTierField(read_only=True)

    class Meta:
        model = NamespaceQuota
        fields = ["id", "namespace", "tier", "bytes", "updated_at"]


class NamespaceQuotaUpdateSerializer(serializers.Serializer):
    bytes = serializers.IntegerField(
        help_text="Bytes the namespace may hold in the tier (per node for host and disk); at least 1."
    )
    comment = _comment()


class NamespaceQuotaCreateSerializer(NamespaceQuotaUpdateSerializer):
    namespace = serializers.CharField(max_length=63, help_text="Name of an existing namespace.")
    tier = QuotaTierField()


class QuotaUsageQuerySerializer(serializers.Serializer):
    namespace = serializers.SlugField(
        max_length=63, required=False, help_text="Only this namespace, in every quota tier (with or without a quota)."
    )


class QuotaNodeUsageSerializer(serializers.Serializer):
    node = serializers.CharField(help_text="Node holding the copies; empty for the shared remote tier.")
    used_bytes = serializers.IntegerField()
    over = serializers.BooleanField()


class QuotaUsageSerializer(serializers.Serializer):
    namespace = serializers.CharField()
    tier = QuotaTierField()
    quota_bytes = serializers.IntegerField(allow_null=True, help_text="Null: no quota in this tier.")
    used_bytes = serializers.IntegerField(
        help_text="Bytes of the namespace's copies: on its fullest node for host and disk, fleet-wide for remote."
    )
    over = serializers.BooleanField(help_text="Whether the namespace holds more than its quota.")
    nodes = QuotaNodeUsageSerializer(many=True, help_text="Use per node (one entry with node empty for remote).")


# -- modes -----------------------------------------------------------------------------------------


@extend_schema_field(
    {
        "type": "string",
        "pattern": "^(" + "|".join(ModeKind.values) + ")$",
        "description": "One of: " + ", ".join(ModeKind.values) + ".",
    }
)
class ModeKindField(serializers.ChoiceField):
    """A mode's kind. The schema gives it as a pattern: an enumeration would be named after the
    field, and other `kind` fields of the API (movements) have other choices."""

    def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(choices=ModeKind.choices, **kwargs)


OVERRIDES_HELP = (
    '{"tiers": [partial tier policies with "tier" (and "node_group")], '
    '"classes": [partial priority classes with "name"]}; fields obey the same rules.'
)


class ModeSerializer(serializers.ModelSerializer[Mode]):
    kind = ModeKindField(read_only=True)

    class Meta:
        model = Mode
        fields = ["name", "kind", "description", "overrides", "active", "updated_at"]


class ModeCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=63)
    kind = ModeKindField(default=ModeKind.CUSTOM)
    description = serializers.CharField(max_length=255, allow_blank=True, default="")
    overrides = serializers.JSONField(default=dict, help_text=OVERRIDES_HELP)
    comment = _comment()


class ModeUpdateSerializer(serializers.Serializer):
    kind = ModeKindField(required=False)
    description = serializers.CharField(max_length=255, allow_blank=True, required=False)
    overrides = serializers.JSONField(required=False, help_text="Replaces the mode's overrides. " + OVERRIDES_HELP)
    comment = _comment()


class ModeSwitchSerializer(serializers.Serializer):
    comment = _comment()


class ModeSwitchOutputSerializer(serializers.Serializer):
    mode = serializers.CharField(help_text="The active mode now (empty: none).")
    version = serializers.IntegerField(help_text="The policy version in force.")
    changed = serializers.BooleanField(help_text="False when the mode was already active.")


class ModeScheduleSerializer(serializers.ModelSerializer[ModeSchedule]):
    mode = serializers.SlugRelatedField(slug_field="name", read_only=True)
    beat_entry = serializers.CharField(
        source="periodic_task.name",
        read_only=True,
        allow_null=True,
        help_text="Name of the django-celery-beat entry that runs the switch.",
    )

    class Meta:
        model = ModeSchedule
        fields = ["id", "mode", "cron", "enabled", "beat_entry", "author", "created_at"]


class ModeScheduleUpdateSerializer(serializers.Serializer):
    mode = serializers.CharField(max_length=63, required=False)
    cron = serializers.CharField(
        max_length=128, required=False, help_text='"minute hour day-of-month month day-of-week", UTC.'
    )
    enabled = serializers.BooleanField(required=False)


class ModeScheduleCreateSerializer(serializers.Serializer):
    mode = serializers.CharField(max_length=63)
    cron = serializers.CharField(max_length=128, help_text='"minute hour day-of-month month day-of-week", UTC.')
    enabled = serializers.BooleanField(default=True)


# -- versions --------------------------------------------------------------------------------------


class PolicyVersionSerializer(serializers.ModelSerializer[PolicyVersion]):
    class Meta:
        model = PolicyVersion
        fields = ["number", "action", "author", "comment", "created_at"]


class PolicyVersionDetailSerializer(PolicyVersionSerializer):
    class Meta(PolicyVersionSerializer.Meta):
        fields = [*PolicyVersionSerializer.Meta.fields, "snapshot"]


class DiffQuerySerializer(serializers.Serializer):
    against = serializers.IntegerField(
        min_value=0, required=False, help_text="The version to compare with; default: the one before."
    )


class ChangeSerializer(serializers.Serializer):
    path = serializers.CharField(help_text="e.g. classes.batch.device_share, tiers.host@fleet.ttl_seconds.")
    change = serializers.ChoiceField(choices=["added", "removed", "changed"])
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class DiffSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    against = serializers.IntegerField()
    changes = ChangeSerializer(many=True, help_text="From `against` to `number`.")


class RollbackSerializer(serializers.Serializer):
    comment = _comment()


# -- dry run ---------------------------------------------------------------------------------------


class DryRunInputSerializer(serializers.Serializer):
    """A proposal, the same shape as a mode's overrides; empty: the policies in force as they are."""

    tiers = serializers.ListField(child=serializers.DictField(), required=False)
    classes = serializers.ListField(child=serializers.DictField(), required=False)


class DryRunQuerySerializer(serializers.Serializer):
    node = serializers.SlugField(max_length=63, required=False, help_text="Plan for this node only.")


class DryRunOutputSerializer(serializers.Serializer):
    """The planner's summary of a plan it did not carry out."""

    plan = serializers.CharField(help_text="Id of the plan (nothing was written under it).")
    policy_version = serializers.IntegerField(help_text="Version of the policies the proposal was laid over.")
    mode = serializers.CharField(help_text="The active mode (empty: none).")
    dry_run = serializers.BooleanField()
    moves = serializers.IntegerField(help_text="Blocks that would move to another tier.")
    evictions = serializers.IntegerField(help_text="Copies that would be dropped.")
    bytes_moved = serializers.IntegerField()
    bytes_evicted = serializers.IntegerField()
    by_route = serializers.JSONField(
        help_text='Blocks and bytes per route, e.g. {"host->remote": {"blocks": 3, "bytes": 12288}}.'
    )
    written = serializers.IntegerField(help_text="Movement rows written: always 0 for a dry run.")
    tiers = serializers.JSONField(help_text="Each tier the planner looked at: capacity, use, watermarks in bytes.")
