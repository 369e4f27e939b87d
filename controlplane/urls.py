"""URL routes of the control plane."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from controlplane.accounts.throttle import login_throttled
from controlplane.dashboard import views as dashboard_views
from controlplane.docs import RedocView, SwaggerView
from controlplane.telemetry import views as telemetry_views

api_v1 = [
    path("", include("controlplane.directory.api.urls")),
    path("", include("controlplane.policies.api.urls")),
    path("", include("controlplane.movements.api.urls")),
    path("", include("controlplane.dashboard.api.urls")),
]

urlpatterns = [
    path("", dashboard_views.overview, name="dashboard-overview-page"),
    path("nodes/", dashboard_views.nodes, name="dashboard-nodes"),
    path("blocks/", dashboard_views.blocks, name="dashboard-blocks"),
    path("requests/", dashboard_views.requests, name="dashboard-requests-page"),
    path("policies/", dashboard_views.policies, name="dashboard-policies"),
    path("movements/", dashboard_views.movements, name="dashboard-movements"),
    path(
        "accounts/login/",
        login_throttled(auth_views.LoginView.as_view(template_name="registration/login.html")),
        name="login",
    ),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Before the admin's own routes: its login form, throttled as the dashboard's is.
    path("admin/login/", login_throttled(admin.site.login)),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", RedocView.as_view(url_name="schema"), name="api-redoc"),
    path("livez", telemetry_views.livez, name="livez"),
    path("readyz", telemetry_views.readyz, name="readyz"),
    path("metrics", telemetry_views.metrics, name="metrics"),
    path("metrics/nodes", telemetry_views.prometheus_nodes, name="metrics-nodes"),
]

handler400 = "controlplane.errors.bad_request"
handler404 = "controlplane.errors.not_found"
handler500 = "controlplane.errors.server_error"
