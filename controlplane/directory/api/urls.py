"""Directory API routes."""

from rest_framework.routers import SimpleRouter

from controlplane.directory.api.views import (
    BlockViewSet,
    ModelProfileViewSet,
    NamespaceViewSet,
    NodeViewSet,
)

router = SimpleRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("namespaces", NamespaceViewSet, basename="namespace")
router.register("model-profiles", ModelProfileViewSet, basename="modelprofile")
router.register("blocks", BlockViewSet, basename="block")
urlpatterns = router.urls
