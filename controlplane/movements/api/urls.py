"""REST routes of the movements app (under /api/v1/): the ledger, and the planner's dry run beside
the policies it previews."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.movements.api.dry_run import PolicyDryRunView
from controlplane.movements.api.views import MovementViewSet

router = SimpleRouter()
router.register("movements", MovementViewSet, basename="movement")
urlpatterns = [
    *router.urls,
    path("policies/dry-run/", PolicyDryRunView.as_view(), name="policies-dry-run"),
]
