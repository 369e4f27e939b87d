"""Directory models: nodes and their tiers; namespaces, model profiles, blocks and their placements."""

import secrets

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import HashIndex
from django.db import models
from django.db.models import Q

from controlplane.directory.choices import (
    DEFAULT_CLASS,
    Dtype,
    NodeState,
    PlacementState,
    TierLevel,
)

SALT_BYTES = 16


def salt_new() -> str:
    """A fresh namespace salt: 16 random bytes as 32 hex characters."""
    return secrets.token_hex(SALT_BYTES)


class Node(models.Model):
    """A GPU node: one engine, one Celery worker on queue node.<name>, its local tiers."""

    name = models.SlugField(max_length=63, unique=True)
    host = models.CharField(max_length=255, help_text="Host name the node runs on.")
    address = models.CharField(max_length=255, blank=True, help_text="host:port of the node's engine server.")
    engine = models.CharField(
        max_length=16,
        default="strata",
        db_default="strata",
        help_text="Engine serving the node's model: strata (the node server) or vllm.",
    )
    engine_address = models.CharField(
        max_length=255,
        blank=True,
        db_default="",
        help_text="host:port of the engine's own server where it is not Strata's (vLLM's OpenAI API and its "
        "/metrics); the node's Strata endpoints stay at `address`.",
    )
    group = models.SlugField(
        max_length=63,
        default="default",
        db_default="default",
        help_text="Node group: tier policies for this group override the fleet-wide ones.",
    )
    state = models.CharField(max_length=8, choices=NodeState.choices, default=NodeState.UP)
    pid = models.PositiveIntegerField(null=True, blank=True)
    version = models.CharField(max_length=32, blank=True)
    heartbeat_seconds = models.FloatField(default=5.0)
    heartbeats = models.PositiveBigIntegerField(default=0)
    seen_from = models.GenericIPAddressField(
        null=True,
        blank=True,
        editable=False,
        help_text="Where the last heartbeat came from, as the database saw the connection (empty: a local "
        "socket). Set by a trigger (migration 0010), never by the node.",
    )
    registered_at = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField()
    stale_after = models.DateTimeField(help_text="When the node counts as stale if no heartbeat arrives.")

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "stale_after"], name="node_state_stale_idx")]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        return f"node.{self.name}"


class NodeCredential(models.Model):
    """A node's own PostgreSQL role (`manage.py strata_node_credential`): with it the node reads the
    directory and writes only its own rows (grants plus row-level security, migration 0009). The
    role is named after the database and the node; revoking it keeps the row, for the record."""

    node = models.SlugField(max_length=63, unique=True, help_text="Name of the node the role acts as.")
    role = models.CharField(max_length=63, unique=True, help_text="The PostgreSQL role (LOGIN) of that node.")
    created_at = models.DateTimeField()
    rotated_at = models.DateTimeField(null=True, blank=True, help_text="When the password last changed.")
    revoked_at = models.DateTimeField(null=True, blank=True, help_text="When the role lost its login.")

    class Meta:
        ordering = ["node"]

    def __str__(self) -> str:
        return f"{self.node} ({self.role})"


class NodeTier(models.Model):
    """Capacity and use of one tier of one node, as its last heartbeat reported."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="tiers")
    tier = models.CharField(max_length=8, choices=TierLevel.choices)
    capacity_bytes = models.PositiveBigIntegerField()
    used_bytes = models.PositiveBigIntegerField()
    available = models.BooleanField(default=True, help_text="False when the node reports the tier unusable.")
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["node_id", "tier"]
        constraints = [
            models.UniqueConstraint(fields=["node", "tier"], name="nodetier_node_tier_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.tier}"


class NodeTraffic(models.Model):
    """A node's traffic over the window before its last heartbeat (worker.dataplane.traffic):
    what load-following derives the fleet's shape from."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, primary_key=True, related_name="traffic")
    window_seconds = models.FloatField()
    requests = models.PositiveIntegerField()
    prompt_tokens = models.PositiveBigIntegerField()
    prompt_buckets = ArrayField(
        models.PositiveIntegerField(), help_text="Prompts per length bucket (traffic.PROMPT_BUCKETS, then the rest)."
    )
    queue_depth = models.PositiveIntegerField(help_text="Requests in flight at the heartbeat.")
    l1_pressure = models.FloatField(help_text="Device tier use over its capacity, 0..1.")
    updated_at = models.DateTimeField()

    class Meta:
        verbose_name_plural = "node traffic"
        constraints = [
            models.CheckConstraint(
                condition=Q(l1_pressure__gte=0) & Q(l1_pressure__lte=1), name="nodetraffic_l1_pressure_fraction"
            ),
            models.CheckConstraint(condition=Q(window_seconds__gt=0), name="nodetraffic_window_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}: {self.requests} requests in {self.window_seconds:.0f} s"


class Namespace(models.Model):
    """A tenant's key space: its salt goes into every fingerprint, so two namespaces never share a
    block unless one of them is marked shared (then any namespace may look its blocks up)."""

    name = models.SlugField(max_length=63, unique=True)
    salt = models.CharField(
        max_length=2 * SALT_BYTES,
        default=salt_new,
        editable=False,
        help_text="Hex of the random salt hashed into every key of this namespace.",
    )
    shared = models.BooleanField(default=False, help_text="Lookups from any namespace also match its blocks.")
    description = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        # Every lookup also matches the shared namespaces: find them without reading the table.
        indexes = [models.Index(fields=["shared"], condition=Q(shared=True), name="namespace_shared_idx")]

    def __str__(self) -> str:
        return self.name

    @property
    def salt_bytes(self) -> bytes:
        return bytes.fromhex(self.salt)


class ModelProfile(models.Model):
    """Everything about a model that changes its KV bytes; `model_key` hashes all of it
    (worker.dataplane.hashing.model_key), so blocks of two layouts can never be confused."""

    name = models.SlugField(max_length=63, unique=True)
    model_id = models.CharField(max_length=255, help_text="Model id, e.g. a Hugging Face repository name.")
    revision = models.CharField(max_length=128, default="main")
    dtype = models.CharField(max_length=8, choices=Dtype.choices, default=Dtype.BFLOAT16)
    layers = models.PositiveIntegerField()
    kv_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    block_tokens = models.PositiveIntegerField(default=256)
    rope_theta = models.FloatField(default=10000.0)
    rope_scaling = models.TextField(blank=True, help_text="Canonical JSON of the RoPE scaling config; empty when none.")
    model_key = models.UUIDField(unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(layers__gt=0) & Q(kv_heads__gt=0) & Q(head_dim__gt=0) & Q(block_tokens__gt=0),
                name="modelprofile_layout_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == Dtype.FLOAT32 else 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block: K and V of every layer."""
        return 2 * self.layers * self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes


class Block(models.Model):
    """A run of `token_count` tokens of one model in one namespace: fingerprint and lifecycle.

    Index plan (every hot query is an index scan at 10M rows, and touches stay HOT updates):
    - (prefix_key, namespace, model) unique: lookup by prefix and the registration upsert;
    - (content_key), a hash index: lookup of fragments anywhere in a prompt, which only ever asks
      for equal keys. It stores a 4-byte hash per block instead of the 16-byte key, so it is about
      two thirds the size of a B-tree on the key: fewer pages for every registration to dirty and
      to log whole after a checkpoint, and less CPU per insert (benchmarks/README.md);
    - (namespace, model, id): purge, the filtered list, newest/oldest order.
    access_count and last_access_at are deliberately not indexed: every touch changes them, and an
    index on them would turn each touch into a write to every index of the table. Nor is priority:
    the planner reads it from blocks it already holds, and no query filters on it, while its two
    indexes (a slug field's default) would take a large share of the index writes of every
    registered block (benchmarks/README.md).

    The foreign keys of blocks and placements are relations for Django only (db_constraint=False):
    PostgreSQL's checks of them would run at every commit, one locking read of the parent per row
    (a large share of a registration batch's time), and every registering node would lock the
    same few namespace, model and node rows. The services keep the references whole instead:
    they resolve
    every name before writing, refuse deleting a namespace or profile that has blocks, and a purge
    removes copies and blocks in one transaction. A copy whose block is gone is never served
    (lookups go through the block)."""

    namespace = models.ForeignKey(
        Namespace, on_delete=models.PROTECT, related_name="blocks", db_index=False, db_constraint=False
    )
    model = models.ForeignKey(
        ModelProfile, on_delete=models.PROTECT, related_name="blocks", db_index=False, db_constraint=False
    )
    prefix_key = models.UUIDField(help_text="H(salt | model key | parent prefix key | tokens): position-exact.")
    content_key = models.UUIDField(help_text="H(salt | model key | tokens): position-independent.")
    position = models.PositiveBigIntegerField(help_text="Offset of the block's first token in its prefix chain.")
    token_count = models.PositiveIntegerField()
    size_bytes = models.PositiveBigIntegerField()
    priority = models.SlugField(
        max_length=63,
        default=DEFAULT_CLASS,
        db_index=False,
        help_text="Priority class (the policies app defines them).",
    )
    created_at = models.DateTimeField()
    last_access_at = models.DateTimeField()
    access_count = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["prefix_key", "namespace", "model"], name="block_prefix_uniq"),
        ]
        indexes = [
            HashIndex(fields=["content_key"], name="block_content_hash", fillfactor=90),
            models.Index(fields=["namespace", "model", "id"], name="block_ns_model_idx"),
        ]

    def __str__(self) -> str:
        return str(self.prefix_key)


class Placement(models.Model):
    """One copy of a block in one tier: where its bytes are and whether they may be served.

    `epoch` grows with every state change; a change made against an older epoch is refused, so two
    movements racing on the same copy cannot both win."""

    block = models.ForeignKey(
        Block, on_delete=models.CASCADE, related_name="placements", db_index=False, db_constraint=False
    )
    tier = models.CharField(max_length=8, choices=TierLevel.choices)
    node = models.ForeignKey(
        Node,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="placements",
        db_index=False,
        db_constraint=False,
        help_text="Node holding the bytes; empty for the shared remote tier.",
    )
    locator = models.CharField(
        max_length=1024, blank=True, help_text="Path, object key or slot in the tier; empty when derived from the key."
    )
    offset = models.PositiveBigIntegerField(default=0)
    size_bytes = models.PositiveBigIntegerField()
    checksum = models.CharField(max_length=32, blank=True, help_text="xxh3-128 of key and bytes, hex.")
    state = models.CharField(max_length=8, choices=PlacementState.choices, default=PlacementState.PENDING)
    epoch = models.PositiveBigIntegerField(default=1)
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["block_id", "tier"]
        constraints = [
            # One copy per (block, tier, node); NULLS NOT DISTINCT makes "one remote copy" hold too.
            models.UniqueConstraint(
                fields=["block", "tier", "node"], name="placement_block_tier_node_uniq", nulls_distinct=False
            ),
            models.CheckConstraint(
                condition=(
                    (Q(tier=TierLevel.REMOTE) & Q(node__isnull=True))
                    | (~Q(tier=TierLevel.REMOTE) & Q(node__isnull=False))
                ),
                name="placement_node_iff_local",
            ),
        ]
        indexes = [models.Index(fields=["node", "tier", "state"], name="placement_node_tier_idx")]

    def __str__(self) -> str:
        return f"{self.block_id}:{self.tier}@{self.node_id or 'shared'}"
