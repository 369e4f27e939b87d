"""Load-following over REST: its settings and state (GET, PATCH by operators) and resuming it
after a manual or scheduled switch held it off (POST resume)."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.policies.api.views import policy_errors
from controlplane.policies.following import (
    SETTINGS,
    hold_of,
    loadfollowing_get,
    loadfollowing_resume,
    loadfollowing_update,
)
from controlplane.policies.models import LoadFollowing


class LoadFollowingSerializer(serializers.ModelSerializer[LoadFollowing]):
    held = serializers.SerializerMethodField(help_text="Why load-following is held off now (empty: it is not).")

    class Meta:
        model = LoadFollowing
        fields = [
            *SETTINGS,
            "mode",
            "switched_at",
            "resumed_at",
            "checked_at",
            "last_reason",
            "held",
            "author",
            "updated_at",
        ]
        read_only_fields = fields

    def get_held(self, row: LoadFollowing) -> str:
        return hold_of(row, timezone.now())


class LoadFollowingUpdateSerializer(serializers.Serializer):
    enabled = serializers.BooleanField(required=False)
    window_seconds = serializers.FloatField(required=False)
    long_prompt_tokens = serializers.IntegerField(required=False)
    chat_enter_rpm = serializers.FloatField(required=False)
    chat_leave_rpm = serializers.FloatField(required=False)
    long_enter_share = serializers.FloatField(required=False)
    long_leave_share = serializers.FloatField(required=False)
    quiet_enter_rpm = serializers.FloatField(required=False)
    quiet_leave_rpm = serializers.FloatField(required=False)
    pressure_enter = serializers.FloatField(required=False)
    queue_enter = serializers.FloatField(required=False)
    min_dwell_seconds = serializers.FloatField(required=False)
    manual_hold_seconds = serializers.FloatField(required=False)
    schedule_hold_seconds = serializers.FloatField(required=False)


class LoadFollowingView(APIView):
    """Load-following's settings and what it last did. Viewers read, operators change."""

    @extend_schema(responses=LoadFollowingSerializer)
    def get(self, request: Request) -> Response:
        return Response(LoadFollowingSerializer(loadfollowing_get()).data)

    @extend_schema(request=LoadFollowingUpdateSerializer, responses=LoadFollowingSerializer)
    def patch(self, request: Request) -> Response:
        if not isinstance(request.data, dict):
            raise ValidationError({"non_field_errors": ["expected an object of settings"]})
        unknown = sorted(set(request.data) - set(SETTINGS))
        if unknown:
            raise ValidationError(
                {"non_field_errors": [f"not load-following settings: {', '.join(map(repr, unknown))}"]}
            )
        data = LoadFollowingUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with policy_errors():
            row = loadfollowing_update(author=request.user.get_username(), **data.validated_data)
        return Response(LoadFollowingSerializer(row).data)


class LoadFollowingResumeView(APIView):
    """End a hold now: the next check follows the traffic again. Operators only."""

    @extend_schema(request=None, responses=LoadFollowingSerializer)
    def post(self, request: Request) -> Response:
        row = loadfollowing_resume(author=request.user.get_username())
        return Response(LoadFollowingSerializer(row).data)
