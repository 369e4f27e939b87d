"""The planner's dry run over REST: what the planner would move and evict under the policies in
force, or under a proposal laid over them. The route sits beside the policies it previews
(`/api/v1/policies/dry-run/`), and the view lives here, with the planner it runs: the policies app
imports nothing of movements."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from controlplane.directory.errors import DirectoryError
from controlplane.movements.services import movements_dry_run
from controlplane.policies.api import serializers as s
from controlplane.policies.api.views import policy_errors


class DryRunThrottle(UserRateThrottle):
    """A plan reads the block tables; a few per minute per user is plenty for editing policies."""

    scope = "policies.dry_run"
    default_rate = "30/min"

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope) or self.default_rate


class PolicyDryRunView(APIView):
    """What the planner would move and evict right now under the policies in force, or under
    `overrides` laid over them, without moving anything. Operators only: a plan is real work."""

    throttle_classes = [*api_settings.DEFAULT_THROTTLE_CLASSES, DryRunThrottle]

    @extend_schema(
        request=s.DryRunInputSerializer, parameters=[s.DryRunQuerySerializer], responses={200: s.DryRunOutputSerializer}
    )
    def post(self, request: Request) -> Response:
        query = s.DryRunQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        try:
            with policy_errors():
                result = movements_dry_run(overrides=request.data or {}, node=query.validated_data.get("node"))
        except DirectoryError as exc:  # the planner's own errors (an unknown node) name their field too
            raise ValidationError({exc.field: [str(exc)]}) from exc
        return Response(result.summary())
