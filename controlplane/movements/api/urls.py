"""REST routes of the movements app (under /api/v1/)."""

from rest_framework.routers import SimpleRouter

from controlplane.movements.api.views import MovementViewSet

router = SimpleRouter()
router.register("movements", MovementViewSet, basename="movement")
urlpatterns = router.urls
