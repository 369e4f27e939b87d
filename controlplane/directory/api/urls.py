"""Directory API routes."""

from rest_framework.routers import SimpleRouter

from controlplane.directory.api.views import NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="node")
urlpatterns = router.urls
