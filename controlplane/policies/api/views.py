"""Policies API views: each validates an input serializer, calls one selector or service, and returns
an output serializer. Reads need the viewer role, writes the operator role (accounts.permissions);
every write records the requesting user as the author of the policy version it creates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.policies.api import serializers as s
from controlplane.policies.errors import InUse, PolicyError
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    NamespaceQuota,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)
from controlplane.policies.quotas import namespacequota_create, namespacequota_delete, namespacequota_update
from controlplane.policies.selectors import (
    modes_list,
    modeschedules_list,
    namespacequotas_list,
    policy_state_diff,
    policyversion_current,
    policyversions_list,
    priorityclasses_list,
    quota_usage,
    tierpolicies_list,
)
from controlplane.policies.services import (
    mode_activate,
    mode_create,
    mode_deactivate,
    mode_delete,
    mode_update,
    modeschedule_create,
    modeschedule_delete,
    modeschedule_update,
    policy_rollback,
    priorityclass_create,
    priorityclass_delete,
    priorityclass_update,
    tierpolicy_create,
    tierpolicy_delete,
    tierpolicy_update,
)

SLUG = r"[-a-zA-Z0-9_]+"


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


@contextmanager
def policy_errors() -> Iterator[None]:
    """Turn a service's typed error into a 400 naming the field (409 for objects in use)."""
    try:
        yield
    except InUse as exc:
        raise Conflict({exc.field: [str(exc)]}) from exc
    except PolicyError as exc:
        raise ValidationError({exc.field: [str(exc)]}) from exc


def _author(request: Request) -> str:
    return request.user.get_username()


def _input(serializer_class: type[serializers.Serializer], request: Request) -> dict:
    data = serializer_class(data=request.data)
    data.is_valid(raise_exception=True)
    return dict(data.validated_data)


class NamePagination(CursorPagination):
    ordering = "name"


class IdPagination(CursorPagination):
    ordering = "id"


class VersionPagination(CursorPagination):
    ordering = "-number"
    page_size_query_param = "page_size"
    max_page_size = 500


class PriorityClassViewSet(viewsets.GenericViewSet[PriorityClass]):
    """Priority classes: which namespaces' blocks count as what, and their cap on the device tier."""

    pagination_class = NamePagination
    lookup_field = "name"
    lookup_value_regex = SLUG
    serializer_class = s.PriorityClassSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return priorityclasses_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.PriorityClassSerializer(page, many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.PriorityClassSerializer(self.get_object()).data)

    @extend_schema(request=s.PriorityClassCreateSerializer, responses={201: s.PriorityClassSerializer})
    def create(self, request: Request) -> Response:
        data = _input(s.PriorityClassCreateSerializer, request)
        with policy_errors():
            row = priorityclass_create(author=_author(request), **data)
        return Response(s.PriorityClassSerializer(row).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.PriorityClassUpdateSerializer, responses=s.PriorityClassSerializer)
    def partial_update(self, request: Request, name: str) -> Response:
        data = _input(s.PriorityClassUpdateSerializer, request)
        with policy_errors():
            row = priorityclass_update(priority_class=self.get_object(), author=_author(request), **data)
        return Response(s.PriorityClassSerializer(row).data)

    @extend_schema(responses={204: None, 409: OpenApiResponse(description="The default class cannot be deleted.")})
    def destroy(self, request: Request, name: str) -> Response:
        with policy_errors():
            priorityclass_delete(priority_class=self.get_object(), author=_author(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TierPolicyViewSet(viewsets.GenericViewSet[TierPolicy]):
    """Tier policies, fleet-wide or per node group: capacity, watermarks, eviction order, TTL."""

    pagination_class = IdPagination
    lookup_value_regex = r"[0-9]{1,18}"
    serializer_class = s.TierPolicySerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return tierpolicies_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.TierPolicySerializer(page, many=True).data)

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(s.TierPolicySerializer(self.get_object()).data)

    @extend_schema(request=s.TierPolicyCreateSerializer, responses={201: s.TierPolicySerializer})
    def create(self, request: Request) -> Response:
        data = _input(s.TierPolicyCreateSerializer, request)
        with policy_errors():
            row = tierpolicy_create(author=_author(request), **data)
        return Response(s.TierPolicySerializer(row).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.TierPolicyUpdateSerializer, responses=s.TierPolicySerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _input(s.TierPolicyUpdateSerializer, request)
        with policy_errors():
            row = tierpolicy_update(policy=self.get_object(), author=_author(request), **data)
        return Response(s.TierPolicySerializer(row).data)

    @extend_schema(responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        with policy_errors():
            tierpolicy_delete(policy=self.get_object(), author=_author(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class NamespaceQuotaViewSet(viewsets.GenericViewSet[NamespaceQuota]):
    """Namespace quotas: bytes a tenant's blocks may hold in the host and disk tiers of each node and
    in the shared remote tier; and what each namespace holds there now."""

    pagination_class = IdPagination
    lookup_value_regex = r"[0-9]{1,18}"
    serializer_class = s.NamespaceQuotaSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return namespacequotas_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.NamespaceQuotaSerializer(page, many=True).data)

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(s.NamespaceQuotaSerializer(self.get_object()).data)

    @extend_schema(request=s.NamespaceQuotaCreateSerializer, responses={201: s.NamespaceQuotaSerializer})
    def create(self, request: Request) -> Response:
        data = _input(s.NamespaceQuotaCreateSerializer, request)
        with policy_errors():
            row = namespacequota_create(author=_author(request), **data)
        return Response(s.NamespaceQuotaSerializer(row).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.NamespaceQuotaUpdateSerializer, responses=s.NamespaceQuotaSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _input(s.NamespaceQuotaUpdateSerializer, request)
        with policy_errors():
            row = namespacequota_update(quota=self.get_object(), author=_author(request), **data)
        return Response(s.NamespaceQuotaSerializer(row).data)

    @extend_schema(responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        with policy_errors():
            namespacequota_delete(quota=self.get_object(), author=_author(request))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        parameters=[s.QuotaUsageQuerySerializer],
        responses=s.QuotaUsageSerializer(many=True),
        description="Per namespace and tier: its quota and the bytes its copies hold (per node for host and "
        "disk, fleet-wide for remote), from the directory's placements.",
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def usage(self, request: Request) -> Response:
        query = s.QuotaUsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        with policy_errors():
            rows = quota_usage(namespace=query.validated_data.get("namespace"))
        return Response(s.QuotaUsageSerializer(rows, many=True).data)


class ModeViewSet(viewsets.GenericViewSet[Mode]):
    """Modes: named overrides of the policies for a load situation; one at most is active."""

    pagination_class = NamePagination
    lookup_field = "name"
    lookup_value_regex = SLUG
    serializer_class = s.ModeSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return modes_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.ModeSerializer(page, many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.ModeSerializer(self.get_object()).data)

    @extend_schema(request=s.ModeCreateSerializer, responses={201: s.ModeSerializer})
    def create(self, request: Request) -> Response:
        data = _input(s.ModeCreateSerializer, request)
        with policy_errors():
            mode = mode_create(author=_author(request), **data)
        return Response(s.ModeSerializer(mode).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ModeUpdateSerializer, responses=s.ModeSerializer)
    def partial_update(self, request: Request, name: str) -> Response:
        data = _input(s.ModeUpdateSerializer, request)
        with policy_errors():
            mode = mode_update(mode=self.get_object(), author=_author(request), **data)
        return Response(s.ModeSerializer(mode).data)

    @extend_schema(responses={204: None, 409: OpenApiResponse(description="The mode is active.")})
    def destroy(self, request: Request, name: str) -> Response:
        with policy_errors():
            mode_delete(mode=self.get_object(), author=_author(request))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        request=s.ModeSwitchSerializer,
        responses=s.ModeSwitchOutputSerializer,
        description="Make this the active mode; its overrides take effect at once.",
    )
    @action(detail=True, methods=["post"])
    def activate(self, request: Request, name: str) -> Response:
        data = _input(s.ModeSwitchSerializer, request)
        with policy_errors():
            version = mode_activate(name=self.get_object().name, author=_author(request), **data)
        return Response(
            s.ModeSwitchOutputSerializer(
                {"mode": name, "version": policyversion_current(), "changed": version is not None}
            ).data
        )

    @extend_schema(
        request=s.ModeSwitchSerializer,
        responses=s.ModeSwitchOutputSerializer,
        description="Stop this (active) mode: the base policies apply alone again.",
    )
    @action(detail=True, methods=["post"])
    def deactivate(self, request: Request, name: str) -> Response:
        data = _input(s.ModeSwitchSerializer, request)
        with policy_errors():
            version = mode_deactivate(name=self.get_object().name, author=_author(request), **data)
        return Response(s.ModeSwitchOutputSerializer({"mode": "", "version": version.number, "changed": True}).data)


class ModeScheduleViewSet(viewsets.GenericViewSet[ModeSchedule]):
    """When to switch modes: cron expressions (UTC) run by django-celery-beat."""

    pagination_class = IdPagination
    lookup_value_regex = r"[0-9]{1,18}"
    serializer_class = s.ModeScheduleSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return modeschedules_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.ModeScheduleSerializer(page, many=True).data)

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(s.ModeScheduleSerializer(self.get_object()).data)

    @extend_schema(request=s.ModeScheduleCreateSerializer, responses={201: s.ModeScheduleSerializer})
    def create(self, request: Request) -> Response:
        data = _input(s.ModeScheduleCreateSerializer, request)
        with policy_errors():
            schedule = modeschedule_create(author=_author(request), **data)
        return Response(s.ModeScheduleSerializer(schedule).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ModeScheduleUpdateSerializer, responses=s.ModeScheduleSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _input(s.ModeScheduleUpdateSerializer, request)
        with policy_errors():
            schedule = modeschedule_update(schedule=self.get_object(), author=_author(request), **data)
        return Response(s.ModeScheduleSerializer(schedule).data)

    @extend_schema(responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        with policy_errors():
            modeschedule_delete(schedule=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class PolicyVersionViewSet(viewsets.GenericViewSet[PolicyVersion]):
    """Every state the policies have been in, newest first; diffs between two; rollback to one."""

    pagination_class = VersionPagination
    lookup_field = "number"
    lookup_value_regex = r"[0-9]{1,9}"
    serializer_class = s.PolicyVersionSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return policyversions_list()

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset().defer("snapshot"))
        return self.get_paginated_response(s.PolicyVersionSerializer(page, many=True).data)

    @extend_schema(responses=s.PolicyVersionDetailSerializer)
    def retrieve(self, request: Request, number: str) -> Response:
        return Response(s.PolicyVersionDetailSerializer(self.get_object()).data)

    @extend_schema(
        parameters=[s.DiffQuerySerializer],
        responses=s.DiffSerializer,
        description="Field-level changes from version `against` (default: the one before) to this one.",
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, number: str) -> Response:
        query = s.DiffQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        version = self.get_object()
        against_number = query.validated_data.get("against", version.number - 1)
        if against_number == 0 and "against" not in query.validated_data:
            before: dict = {}
        else:
            against = PolicyVersion.objects.filter(number=against_number).first()
            if against is None:
                raise ValidationError({"against": [f"against: no policy version {against_number}"]})
            before = against.snapshot
        changes = policy_state_diff(before, version.snapshot)
        return Response(
            s.DiffSerializer({"number": version.number, "against": against_number, "changes": changes}).data
        )

    @extend_schema(
        request=s.RollbackSerializer,
        responses={201: s.PolicyVersionDetailSerializer},
        description="Restore the policies of this version; the result is a new version.",
    )
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, number: str) -> Response:
        data = _input(s.RollbackSerializer, request)
        with policy_errors():
            written = policy_rollback(version=self.get_object().number, author=_author(request), **data)
        return Response(s.PolicyVersionDetailSerializer(written).data, status=status.HTTP_201_CREATED)
