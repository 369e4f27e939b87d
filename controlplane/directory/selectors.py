"""Directory reads."""

from django.db.models import QuerySet

from controlplane.directory.models import Node


def nodes_list() -> QuerySet[Node]:
    """All nodes with their tiers, in name order (two queries whatever the count)."""
    return Node.objects.prefetch_related("tiers").order_by("name")
