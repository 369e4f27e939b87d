"""REST routes of the policies app (under /api/v1/)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.policies.api.following import LoadFollowingResumeView, LoadFollowingView
from controlplane.policies.api.views import (
    ModeScheduleViewSet,
    ModeViewSet,
    NamespaceQuotaViewSet,
    PolicyVersionViewSet,
    PriorityClassViewSet,
    TierPolicyViewSet,
)

router = SimpleRouter()
router.register("priority-classes", PriorityClassViewSet, basename="priorityclass")
router.register("tier-policies", TierPolicyViewSet, basename="tierpolicy")
router.register("namespace-quotas", NamespaceQuotaViewSet, basename="namespacequota")
router.register("modes", ModeViewSet, basename="mode")
router.register("mode-schedules", ModeScheduleViewSet, basename="modeschedule")
router.register("policy-versions", PolicyVersionViewSet, basename="policyversion")
urlpatterns = [
    *router.urls,
    path("load-following/", LoadFollowingView.as_view(), name="load-following"),
    path("load-following/resume/", LoadFollowingResumeView.as_view(), name="load-following-resume"),
]
