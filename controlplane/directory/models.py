"""Directory models: the nodes and their tiers."""

from django.db import models

from controlplane.directory.choices import NodeState, Tier


class Node(models.Model):
    """A GPU node: one engine, one Celery worker on queue node.<name>, its local tiers."""

    name = models.SlugField(max_length=63, unique=True)
    host = models.CharField(max_length=255, help_text="Host name the node runs on.")
    address = models.CharField(max_length=255, blank=True, help_text="host:port of the node's engine server.")
    state = models.CharField(max_length=8, choices=NodeState.choices, default=NodeState.UP)
    pid = models.PositiveIntegerField(null=True, blank=True)
    version = models.CharField(max_length=32, blank=True)
    heartbeat_seconds = models.FloatField(default=5.0)
    heartbeats = models.PositiveBigIntegerField(default=0)
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


class NodeTier(models.Model):
    """Capacity and use of one tier of one node, as its last heartbeat reported."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="tiers")
    tier = models.CharField(max_length=8, choices=Tier.choices)
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
