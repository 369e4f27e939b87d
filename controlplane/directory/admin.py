"""Admin pages of the directory."""

from django.contrib import admin

from controlplane.directory.models import Node, NodeTier


class NodeTierInline(admin.TabularInline):
    model = NodeTier
    extra = 0
    readonly_fields = ["tier", "capacity_bytes", "used_bytes", "available", "updated_at"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "host", "address", "last_seen", "heartbeats"]
    list_filter = ["state"]
    search_fields = ["name", "host"]
    readonly_fields = ["registered_at", "last_seen", "stale_after", "heartbeats", "pid", "version"]
    inlines = [NodeTierInline]
