"""Directory API serializers."""

from rest_framework import serializers

from controlplane.directory.models import Node, NodeTier


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
            "name", "host", "address", "state", "queue", "pid", "version", "heartbeat_seconds",
            "heartbeats", "registered_at", "last_seen", "stale_after", "tiers",
        ]
