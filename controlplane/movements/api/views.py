"""Movements API views: the ledger (read by every role) and "run migration now" (operators)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings

from controlplane.accounts.roles import Role
from controlplane.directory.api.views import BlockPagination, DirectoryThrottle, directory_errors
from controlplane.movements.api import serializers as s
from controlplane.movements.models import Movement
from controlplane.movements.selectors import MOVEMENT_ORDERINGS, movement_get, movements_list
from controlplane.movements.services import movements_run, movements_warm


class RunThrottle(DirectoryThrottle):
    scope = "movements.run"
    default_rate = "60/min"


class MovementPagination(BlockPagination):
    """Cursor pages in id order (newest first unless `ordering=id`)."""

    ordering = MOVEMENT_ORDERINGS["-id"]


class MovementViewSet(viewsets.GenericViewSet[Movement]):
    """The movements ledger: every planned, running and finished move, eviction and warm-up, with
    its reason, bytes, duration, result and policy version."""

    pagination_class = MovementPagination
    serializer_class = s.MovementSerializer
    lookup_value_regex = r"[0-9]{1,18}"
    write_role = Role.OPERATOR

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return movements_list()

    @extend_schema(parameters=[s.MovementListQuerySerializer], responses=s.MovementSerializer(many=True))
    def list(self, request: Request) -> Response:
        query = s.MovementListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        filters = dict(query.validated_data)
        self.block_ordering = MOVEMENT_ORDERINGS[filters.pop("ordering")]
        if "plan" in filters:
            filters["plan"] = str(filters["plan"])
        page = self.paginate_queryset(movements_list(**filters))
        return self.get_paginated_response(s.MovementSerializer(page, many=True).data)

    @extend_schema(responses=s.MovementSerializer)
    def retrieve(self, request: Request, pk: str) -> Response:
        movement = movement_get(movement_id=int(pk))
        if movement is None:
            raise NotFound(f"no movement {pk}")
        return Response(s.MovementSerializer(movement).data)

    @extend_schema(
        request=s.RunInputSerializer,
        responses=s.PlanSummarySerializer,
        description="Run migration now: plan under the policies in force and dispatch to the nodes.",
    )
    @action(detail=False, methods=["post"], throttle_classes=[*api_settings.DEFAULT_THROTTLE_CLASSES, RunThrottle])
    def run(self, request: Request) -> Response:
        data = s.RunInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with directory_errors():
            result = movements_run(**data.validated_data)
        return Response(s.PlanSummarySerializer(result.summary()).data)

    @extend_schema(
        request=s.WarmInputSerializer,
        responses=s.PlanSummarySerializer,
        description="Warm a node's host tier from the remote tier ahead of a scheduled job.",
    )
    @action(detail=False, methods=["post"], throttle_classes=[*api_settings.DEFAULT_THROTTLE_CLASSES, RunThrottle])
    def warm(self, request: Request) -> Response:
        data = s.WarmInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body = dict(data.validated_data)
        body["block_ids"] = body.pop("blocks", None)
        with directory_errors():
            result = movements_warm(**body)
        return Response(s.PlanSummarySerializer(result.summary()).data)
