"""Directory API views."""

from rest_framework import viewsets
from rest_framework.pagination import CursorPagination

from controlplane.directory.api.serializers import NodeSerializer
from controlplane.directory.models import Node
from controlplane.directory.selectors import nodes_list


class NodePagination(CursorPagination):
    ordering = "name"


class NodeViewSet(viewsets.ReadOnlyModelViewSet[Node]):
    """GPU nodes, their state and per-tier capacity and use (read only: nodes register themselves)."""

    serializer_class = NodeSerializer
    pagination_class = NodePagination
    lookup_field = "name"

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return nodes_list()
