"""Dashboard API views: read-only, for every role from viewer up (the default RolePermission)."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.dashboard.selectors import (
    blocks_by_fingerprint,
    cache_stats,
    overview_get,
    requests_recent,
)
from controlplane.directory.api.serializers import BlockSerializer


class NodeFilterSerializer(serializers.Serializer):
    node = serializers.SlugField(max_length=63, required=False, help_text="Only this node.")


NODE_PARAMETER = OpenApiParameter("node", OpenApiTypes.STR, description="Only this node.")


class OverviewView(APIView):
    """Nodes, tier occupancy (per node and fleet-wide), watermarks, the mode in force and alerts,
    with the dashboard event sequence number the snapshot is current at."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(overview_get())


class CacheStatsView(APIView):
    """Cumulative lookup and hit tokens of every serving node (from its engine's /metrics), hit
    tokens by the tier the blocks came from, and fragment reuse: reused tokens split into prefix and
    fragment, the recompute ratio, quality samples, and the current r and prefix-only fallback of
    every (node, model, namespace)."""

    @extend_schema(parameters=[NODE_PARAMETER], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        query = NodeFilterSerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        return Response(cache_stats(node=query.validated_data.get("node")))


class RequestsView(APIView):
    """The latest requests of every serving node (or one): which tier served how many blocks, the
    stall of each layer, TTFT, load and prefill time; and tokens served from cache vs recomputed
    with the estimated prefill time saved, and reused tokens split into prefix and fragment."""

    @extend_schema(parameters=[NODE_PARAMETER], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        query = NodeFilterSerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        return Response(requests_recent(node=query.validated_data.get("node")))


class FingerprintQuerySerializer(serializers.Serializer):
    key = serializers.UUIDField(help_text="A prefix key or content key (the block's fingerprint).")


class BlockSearchView(APIView):
    """Blocks whose prefix key or content key is the fingerprint given (newest first, at most 100)."""

    @extend_schema(parameters=[FingerprintQuerySerializer], responses=BlockSerializer(many=True))
    def get(self, request: Request) -> Response:
        query = FingerprintQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        found = blocks_by_fingerprint(key=query.validated_data["key"])
        return Response({"results": BlockSerializer(found, many=True).data})
