"""Dashboard API routes (under /api/v1/)."""

from django.urls import path

from controlplane.dashboard.api import views

urlpatterns = [
    path("dashboard/overview/", views.OverviewView.as_view(), name="dashboard-overview"),
    path("dashboard/cache/", views.CacheStatsView.as_view(), name="dashboard-cache"),
    path("dashboard/blocks/", views.BlockSearchView.as_view(), name="dashboard-block-search"),
    path("requests/", views.RequestsView.as_view(), name="dashboard-requests"),
]
