"""Directory API serializers: inputs are validated here, outputs shaped here; the work is in services."""

import uuid
from typing import Any

from rest_framework import serializers

from controlplane.directory.choices import (
    MAX_BATCH,
    BlockOrdering,
    Dtype,
    PlacementState,
    TierLevel,
)
from controlplane.directory.models import Block, ModelProfile, Namespace, Node, NodeTier, Placement
from worker.dataplane.directory import BlockLocation

# Upper bounds of the database columns, so an oversized number is a 400 naming the field, not a 500.
BIGINT_MAX = 2**63 - 1
INTEGER_MAX = 2**31 - 1
CHECKSUM_PATTERN = r"^[0-9a-f]{32}$"


class NodeTierSerializer(serializers.ModelSerializer[NodeTier]):
    class Meta:
        model = NodeTier
        fields = ["tier", "capacity_bytes", "used_bytes", "available", "updated_at"]


class NodeSerializer(serializers.ModelSerializer[Node]):
    tiers = NodeTierSerializer(many=True, read_only=True)
    queue = serializers.CharField(read_only=True)

    class Meta:
        model = Node
        fields = [
            "name",
            "group",
            "host",
            "address",
            "engine",
            "engine_address",
            "state",
            "queue",
            "pid",
            "version",
            "heartbeat_seconds",
            "heartbeats",
            "registered_at",
            "last_seen",
            "stale_after",
            "tiers",
        ]


# -- namespaces ------------------------------------------------------------------------------------


class NamespaceSerializer(serializers.ModelSerializer[Namespace]):
    class Meta:
        model = Namespace
        fields = ["name", "shared", "description", "created_at"]


class NamespaceWithSaltSerializer(serializers.ModelSerializer[Namespace]):
    """For operators and engines: the salt is what an engine hashes into this namespace's keys."""

    # Output only; declared optional because viewers get the same object without it.
    salt = serializers.CharField(required=False, help_text="Hex of the namespace's random salt (operators and admins).")

    class Meta:
        model = Namespace
        fields = ["name", "shared", "description", "created_at", "salt"]


class NamespaceCreateSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=63)
    shared = serializers.BooleanField(default=False)
    description = serializers.CharField(max_length=255, allow_blank=True, default="")


class NamespaceUpdateSerializer(serializers.Serializer):
    shared = serializers.BooleanField(required=False)
    description = serializers.CharField(max_length=255, allow_blank=True, required=False)


# -- model profiles --------------------------------------------------------------------------------


class ModelProfileSerializer(serializers.ModelSerializer[ModelProfile]):
    block_bytes = serializers.IntegerField(read_only=True)

    class Meta:
        model = ModelProfile
        fields = [
            "name",
            "model_id",
            "revision",
            "dtype",
            "layers",
            "kv_heads",
            "head_dim",
            "block_tokens",
            "rope_theta",
            "rope_scaling",
            "model_key",
            "block_bytes",
            "created_at",
        ]


class ModelProfileCreateSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=63)
    model_id = serializers.CharField(max_length=255)
    revision = serializers.CharField(max_length=128, default="main")
    dtype = serializers.ChoiceField(choices=Dtype.choices, default=Dtype.BFLOAT16)
    layers = serializers.IntegerField(min_value=1, max_value=INTEGER_MAX)
    kv_heads = serializers.IntegerField(min_value=1, max_value=INTEGER_MAX)
    head_dim = serializers.IntegerField(min_value=1, max_value=INTEGER_MAX)
    block_tokens = serializers.IntegerField(min_value=1, max_value=INTEGER_MAX, default=256)
    rope_theta = serializers.FloatField(min_value=0.0, default=10000.0)
    rope_scaling = serializers.DictField(
        required=False, allow_empty=True, help_text="RoPE scaling config as in the model's config.json."
    )


# -- blocks ----------------------------------------------------------------------------------------


class PlacementSerializer(serializers.ModelSerializer[Placement]):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Placement
        fields = ["id", "tier", "node", "locator", "offset", "size_bytes", "checksum", "state", "epoch", "updated_at"]


class BlockSerializer(serializers.ModelSerializer[Block]):
    namespace = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Block
        fields = [
            "id",
            "namespace",
            "model",
            "prefix_key",
            "content_key",
            "position",
            "token_count",
            "size_bytes",
            "priority",
            "created_at",
            "last_access_at",
            "access_count",
        ]


class BlockDetailSerializer(BlockSerializer):
    placements = PlacementSerializer(many=True, read_only=True)

    class Meta(BlockSerializer.Meta):
        fields = [*BlockSerializer.Meta.fields, "placements"]


class BlockListQuerySerializer(serializers.Serializer):
    namespace = serializers.SlugField(max_length=63, required=False, help_text="Namespace name.")
    model = serializers.SlugField(max_length=63, required=False, help_text="Model profile name.")
    tier = serializers.ChoiceField(choices=TierLevel.choices, required=False, help_text="Has a copy in this tier.")
    node = serializers.SlugField(max_length=63, required=False, help_text="Has a copy on this node.")
    state = serializers.ChoiceField(
        choices=PlacementState.choices, required=False, help_text="Has a copy in this state."
    )
    ordering = serializers.ChoiceField(
        choices=BlockOrdering.choices,
        default=BlockOrdering.NEWEST,
        help_text="-access_count is the hotness ranking; -created_at the age.",
    )


class UUIDListField(serializers.ListField):
    """A list of UUIDs in their string form, parsed in one pass: DRF's per-element validation
    costs tens of milliseconds on a 4096-key lookup (benchmarks/README.md). Anything else (an
    int, a malformed string) takes the per-element path, so errors name the element."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.UUIDField(), **kwargs)

    def run_child_validation(self, data: list[Any]) -> list[uuid.UUID]:
        if all(type(value) is str for value in data):
            try:
                return [uuid.UUID(hex=value) for value in data]
            except ValueError:
                pass
        return super().run_child_validation(data)


class LookupInputSerializer(serializers.Serializer):
    namespace = serializers.SlugField(max_length=63)
    model_key = serializers.UUIDField(help_text="Model key of the profile the keys were computed for.")
    node = serializers.SlugField(
        max_length=63,
        required=False,
        allow_null=True,
        default=None,
        help_text="Asking node: its local copies, then the remote tier. Empty: any node.",
    )
    prefix_keys = UUIDListField(
        max_length=MAX_BATCH, default=list, help_text="Prefix keys of a prompt's blocks, in chain order."
    )
    content_keys = UUIDListField(
        max_length=MAX_BATCH, default=list, help_text="Content keys to match anywhere (fragments)."
    )

    def validate(self, attrs):  # type: ignore[no-untyped-def]
        if len(attrs["prefix_keys"]) + len(attrs["content_keys"]) > MAX_BATCH:
            raise serializers.ValidationError(
                {"prefix_keys": [f"at most {MAX_BATCH} keys per lookup, prefix and content keys together"]}
            )
        return attrs


class BlockLocationSerializer(serializers.Serializer):
    """One hit. A lookup answers up to 4096 of them, so the representation is built in one step
    from the location (the declared fields document it) rather than field by field."""

    key = serializers.UUIDField()
    prefix_key = serializers.UUIDField()
    content_key = serializers.UUIDField()
    position = serializers.IntegerField()
    token_count = serializers.IntegerField(source="tokens")
    block_id = serializers.IntegerField()
    placement_id = serializers.IntegerField()
    tier = serializers.ChoiceField(choices=TierLevel.choices)
    node = serializers.CharField(allow_null=True)
    locator = serializers.CharField(allow_blank=True)
    offset = serializers.IntegerField()
    size_bytes = serializers.IntegerField(source="nbytes")
    checksum = serializers.CharField(allow_blank=True)
    epoch = serializers.IntegerField()

    def to_representation(self, instance: BlockLocation) -> dict[str, object]:
        return {
            "key": str(instance.key),
            "prefix_key": str(instance.prefix_key),
            "content_key": str(instance.content_key),
            "position": instance.position,
            "token_count": instance.tokens,
            "block_id": instance.block_id,
            "placement_id": instance.placement_id,
            "tier": instance.tier,
            "node": instance.node,
            "locator": instance.locator,
            "offset": instance.offset,
            "size_bytes": instance.nbytes,
            "checksum": instance.checksum,
            "epoch": instance.epoch,
        }


class LookupOutputSerializer(serializers.Serializer):
    prefix = serializers.ListField(
        child=BlockLocationSerializer(allow_null=True),
        help_text="One entry per prefix key asked, in order; null is a miss.",
    )
    content = serializers.ListField(
        child=BlockLocationSerializer(allow_null=True),
        help_text="One entry per content key asked, in order; null is a miss.",
    )
    prefix_hit_blocks = serializers.IntegerField(help_text="Leading prefix hits: the reusable prefix, in blocks.")
    hits = serializers.IntegerField()


class RegisterBlockSerializer(serializers.Serializer):
    prefix_key = serializers.UUIDField()
    content_key = serializers.UUIDField()
    position = serializers.IntegerField(min_value=0, max_value=BIGINT_MAX)
    token_count = serializers.IntegerField(min_value=1, max_value=INTEGER_MAX)
    size_bytes = serializers.IntegerField(min_value=0, max_value=BIGINT_MAX)
    tier = serializers.ChoiceField(choices=TierLevel.choices)
    locator = serializers.CharField(max_length=1024, allow_blank=True, default="")
    offset = serializers.IntegerField(min_value=0, max_value=BIGINT_MAX, default=0)
    checksum = serializers.RegexField(
        CHECKSUM_PATTERN,
        allow_blank=True,
        default="",
        help_text="xxh3-128 of key and bytes, 32 lower-case hex characters.",
    )
    priority = serializers.SlugField(max_length=63, default="default")


class RegisterInputSerializer(serializers.Serializer):
    namespace = serializers.SlugField(max_length=63)
    model_key = serializers.UUIDField()
    node = serializers.SlugField(
        max_length=63,
        required=False,
        allow_null=True,
        default=None,
        help_text="Node holding the device/host/disk copies; not needed for remote ones.",
    )
    blocks = serializers.ListField(child=RegisterBlockSerializer(), min_length=1, max_length=MAX_BATCH)

    def validate(self, attrs):  # type: ignore[no-untyped-def]
        local = [i for i, b in enumerate(attrs["blocks"]) if b["tier"] != TierLevel.REMOTE]
        if local and not attrs.get("node"):
            raise serializers.ValidationError(
                {
                    "node": [
                        f"required: block {local[0]} has a {attrs['blocks'][local[0]]['tier']} copy, which "
                        "lives on a node"
                    ]
                }
            )
        return attrs


class RegisterOutputSerializer(serializers.Serializer):
    blocks = serializers.IntegerField(help_text="Blocks in the request.")
    new = serializers.IntegerField(help_text="Blocks the directory did not know before.")
    placements = serializers.IntegerField(help_text="Copies created or changed.")


class PurgeInputSerializer(serializers.Serializer):
    namespace = serializers.SlugField(max_length=63)
    model = serializers.SlugField(
        max_length=63,
        required=False,
        allow_null=True,
        default=None,
        help_text="Model profile name; empty purges every model of the namespace.",
    )


class PurgeOutputSerializer(serializers.Serializer):
    blocks = serializers.IntegerField()
    placements = serializers.IntegerField()
