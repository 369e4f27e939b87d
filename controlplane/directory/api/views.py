"""Directory API views: each validates an input serializer, calls one selector or service, and
returns an output serializer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.throttling import UserRateThrottle

from controlplane.accounts.roles import Role, role_of
from controlplane.directory.api import serializers as s
from controlplane.directory.choices import BLOCK_ORDERING_COLUMNS, BlockOrdering, TierLevel
from controlplane.directory.errors import DirectoryError, InUse
from controlplane.directory.models import Block, ModelProfile, Namespace, Node
from controlplane.directory.selectors import (
    block_get,
    blocks_list,
    blocks_lookup,
    modelprofiles_list,
    namespaces_list,
    nodes_list,
)
from controlplane.directory.services import (
    blocks_purge,
    blocks_register,
    modelprofile_create,
    modelprofile_delete,
    namespace_create,
    namespace_delete,
    namespace_update,
)
from worker.dataplane.directory import BlockRegistration


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


@contextmanager
def directory_errors() -> Iterator[None]:
    """Turn a service's typed error into a 400 naming the field (409 for objects still in use)."""
    try:
        yield
    except InUse as exc:
        raise Conflict({exc.field: [str(exc)]}) from exc
    except DirectoryError as exc:
        raise ValidationError({exc.field: [str(exc)]}) from exc


class WindowRateThrottle(UserRateThrottle):
    """A user's rate counted per fixed window of the rate's period: one counter increment per
    request, whatever the rate. DRF's own throttle keeps the time of every request in the period
    and reads and writes that whole list back on each request; for an engine doing 1,000 lookups a
    second it is a list of 60,000 times, milliseconds a request on its own (benchmarks/README.md).
    The price: a
    burst that straddles two windows may reach twice the rate within one period, which is harmless
    for rates this far above what an engine legitimately sends."""

    def allow_request(self, request: Request, view: object) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        window = int(self.timer() // self.duration)
        self.window_ends = (window + 1) * self.duration
        return self._count(f"{self.key}:{window}") <= self.num_requests

    def _count(self, key: str) -> int:
        try:
            return int(self.cache.incr(key))
        except ValueError:  # the window's first request
            if self.cache.add(key, 1, timeout=int(self.duration) + 1):
                return 1
            return int(self.cache.incr(key))

    def wait(self) -> float:
        return max(self.window_ends - self.timer(), 0.0)


class DirectoryThrottle(UserRateThrottle):
    """A per-user rate for one expensive action; settings may override it by scope."""

    default_rate = "1000/min"

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope) or self.default_rate


class RegisterThrottle(WindowRateThrottle, DirectoryThrottle):
    scope = "directory.register"
    default_rate = "12000/min"  # up to 4096 blocks each: far above what one engine writes


class PurgeThrottle(DirectoryThrottle):
    scope = "directory.purge"
    default_rate = "30/min"


def _throttles(*extra: type) -> list[type]:
    """The default throttles, the per-user one counted per window (engines call these endpoints
    at high rates: see WindowRateThrottle), then `extra`."""
    return [
        WindowRateThrottle if cls is UserRateThrottle else cls for cls in api_settings.DEFAULT_THROTTLE_CLASSES
    ] + list(extra)


class NamePagination(CursorPagination):
    ordering = "name"


class NodeViewSet(viewsets.ReadOnlyModelViewSet[Node]):
    """GPU nodes, their state and per-tier capacity and use (read only: nodes register themselves)."""

    serializer_class = s.NodeSerializer
    pagination_class = NamePagination
    lookup_field = "name"

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return nodes_list()


def _can_see_salts(request: Request) -> bool:
    return role_of(request.user) >= Role.OPERATOR


@extend_schema_view(
    list=extend_schema(
        responses=s.NamespaceWithSaltSerializer(many=True),
        description="Namespaces; `salt` only for operators and admins.",
    ),
    retrieve=extend_schema(
        responses=s.NamespaceWithSaltSerializer, description="A namespace; `salt` only for operators and admins."
    ),
)
class NamespaceViewSet(viewsets.GenericViewSet[Namespace]):
    """Tenants' key spaces. Each has a random salt hashed into its keys; shared ones match from any
    namespace."""

    pagination_class = NamePagination
    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    serializer_class = s.NamespaceWithSaltSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return namespaces_list()

    def _output(self, request: Request) -> type[s.NamespaceSerializer] | type[s.NamespaceWithSaltSerializer]:
        return s.NamespaceWithSaltSerializer if _can_see_salts(request) else s.NamespaceSerializer

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self._output(request)(page, many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(self._output(request)(self.get_object()).data)

    @extend_schema(request=s.NamespaceCreateSerializer, responses={201: s.NamespaceWithSaltSerializer})
    def create(self, request: Request) -> Response:
        data = s.NamespaceCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with directory_errors():
            namespace = namespace_create(**data.validated_data)
        return Response(s.NamespaceWithSaltSerializer(namespace).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.NamespaceUpdateSerializer, responses=s.NamespaceWithSaltSerializer)
    def partial_update(self, request: Request, name: str) -> Response:
        data = s.NamespaceUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        namespace = namespace_update(namespace=self.get_object(), **data.validated_data)
        return Response(s.NamespaceWithSaltSerializer(namespace).data)

    @extend_schema(responses={204: None, 409: OpenApiResponse(description="The namespace still has blocks.")})
    def destroy(self, request: Request, name: str) -> Response:
        with directory_errors():
            namespace_delete(namespace=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class ModelProfileViewSet(viewsets.GenericViewSet[ModelProfile]):
    """Model layouts. The model key hashes every field that changes KV bytes, so profiles are
    created and deleted, never edited."""

    pagination_class = NamePagination
    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    serializer_class = s.ModelProfileSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return modelprofiles_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.ModelProfileSerializer(page, many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.ModelProfileSerializer(self.get_object()).data)

    @extend_schema(request=s.ModelProfileCreateSerializer, responses={201: s.ModelProfileSerializer})
    def create(self, request: Request) -> Response:
        data = s.ModelProfileCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with directory_errors():
            profile = modelprofile_create(**data.validated_data)
        return Response(s.ModelProfileSerializer(profile).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None, 409: OpenApiResponse(description="The profile still has blocks.")})
    def destroy(self, request: Request, name: str) -> Response:
        with directory_errors():
            modelprofile_delete(profile=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class BlockPagination(CursorPagination):
    """Cursor pages over an ordering the request chooses (a unique column tuple from choices)."""

    page_size_query_param = "page_size"
    max_page_size = 1000
    ordering = BLOCK_ORDERING_COLUMNS[BlockOrdering.NEWEST]

    def get_ordering(self, request, queryset, view):  # type: ignore[no-untyped-def]
        return getattr(view, "block_ordering", self.ordering)

    def paginate_queryset(self, queryset, request, view=None):  # type: ignore[no-untyped-def]
        try:
            return super().paginate_queryset(queryset, request, view)
        except (ValueError, TypeError, DjangoValidationError) as exc:
            # A well-formed cursor whose position does not fit the ordering's column.
            raise NotFound(self.invalid_cursor_message) from exc


class BlockViewSet(viewsets.GenericViewSet[Block]):
    """Blocks: fingerprint, lifecycle and copies; batched hit detection and registration for
    engines; purge for admins."""

    pagination_class = BlockPagination
    serializer_class = s.BlockSerializer
    lookup_value_regex = r"[0-9]{1,18}"
    throttle_classes = _throttles()

    @property
    def write_role(self) -> Role:
        # A lookup is a read that needs a body; a purge forgets data for good.
        return {"lookup": Role.VIEWER, "purge": Role.ADMIN}.get(getattr(self, "action", ""), Role.OPERATOR)

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return blocks_list()

    @extend_schema(parameters=[s.BlockListQuerySerializer], responses=s.BlockSerializer(many=True))
    def list(self, request: Request) -> Response:
        query = s.BlockListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        self.block_ordering = BLOCK_ORDERING_COLUMNS[query.validated_data["ordering"]]
        page = self.paginate_queryset(blocks_list(**query.validated_data))
        return self.get_paginated_response(s.BlockSerializer(page, many=True).data)

    @extend_schema(responses=s.BlockDetailSerializer)
    def retrieve(self, request: Request, pk: str) -> Response:
        block = block_get(block_id=int(pk))
        if block is None:
            raise NotFound(f"no block {pk}")
        return Response(s.BlockDetailSerializer(block).data)

    @extend_schema(
        request=s.LookupInputSerializer,
        responses=s.LookupOutputSerializer,
        description="Batched hit detection: each key's best READY copy, in one query.",
    )
    @action(detail=False, methods=["post"])
    def lookup(self, request: Request) -> Response:
        data = s.LookupInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with directory_errors():
            result = blocks_lookup(strict=True, **data.validated_data)
        return Response(
            s.LookupOutputSerializer(
                {
                    "prefix": result.prefix,
                    "content": result.content,
                    "prefix_hit_blocks": result.prefix_hit_blocks,
                    "hits": result.hits,
                }
            ).data
        )

    @extend_schema(
        request=s.RegisterInputSerializer,
        responses=s.RegisterOutputSerializer,
        description="Batched registration of blocks and one READY copy each; all or nothing.",
    )
    @action(detail=False, methods=["post"], throttle_classes=_throttles(RegisterThrottle))
    def register(self, request: Request) -> Response:
        data = s.RegisterInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body = data.validated_data
        registrations = [
            BlockRegistration(
                namespace=body["namespace"],
                model_key=body["model_key"],
                prefix_key=b["prefix_key"],
                content_key=b["content_key"],
                position=b["position"],
                tokens=b["token_count"],
                tier=b["tier"],
                node=None if b["tier"] == TierLevel.REMOTE else body["node"],
                nbytes=b["size_bytes"],
                checksum=b["checksum"],
                locator=b["locator"],
                offset=b["offset"],
                priority=b["priority"],
            )
            for b in body["blocks"]
        ]
        with directory_errors():
            counts = blocks_register(registrations=registrations, source=f"api:{request.user.get_username()}")
        return Response(
            s.RegisterOutputSerializer(
                {"blocks": len(registrations), "new": counts.blocks, "placements": counts.placements}
            ).data
        )

    @extend_schema(
        request=s.PurgeInputSerializer,
        responses=s.PurgeOutputSerializer,
        description="Admins only: forget every block of a namespace (and model).",
    )
    @action(detail=False, methods=["post"], throttle_classes=_throttles(PurgeThrottle))
    def purge(self, request: Request) -> Response:
        data = s.PurgeInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with directory_errors():
            counts = blocks_purge(**data.validated_data)
        return Response(s.PurgeOutputSerializer(counts).data)
