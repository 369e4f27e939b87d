"""Admin pages of the directory."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.http import HttpRequest
from django.utils.functional import cached_property

from controlplane.directory.models import Block, ModelProfile, Namespace, Node, NodeTier, Placement
from controlplane.directory.services import modelprofile_create


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


class EstimatedCountPaginator(Paginator):
    """Counting 10M rows takes seconds; an unfiltered list uses the planner's row estimate."""

    @cached_property
    def count(self) -> int:  # type: ignore[override]
        query = getattr(self.object_list, "query", None)
        model = getattr(self.object_list, "model", None)
        if query is not None and model is not None and not query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [model._meta.db_table]
                )
                row = cursor.fetchone()
            if row and row[0] and row[0] > 10000:
                return int(row[0])
        return super().count


@admin.register(Namespace)
class NamespaceAdmin(admin.ModelAdmin):
    list_display = ["name", "shared", "description", "created_at"]
    list_filter = ["shared"]
    search_fields = ["name"]
    readonly_fields = ["salt", "created_at"]


@admin.register(ModelProfile)
class ModelProfileAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "model_id",
        "revision",
        "dtype",
        "layers",
        "kv_heads",
        "head_dim",
        "block_tokens",
        "model_key",
    ]
    search_fields = ["name", "model_id"]
    _layout = [
        "model_id",
        "revision",
        "dtype",
        "layers",
        "kv_heads",
        "head_dim",
        "block_tokens",
        "rope_theta",
        "rope_scaling",
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The key hashes the layout: a saved profile's layout never changes.
        return ["model_key", "created_at", *self._layout] if obj else ["model_key", "created_at"]

    def save_model(self, request: HttpRequest, obj: ModelProfile, form: Any, change: bool) -> None:
        if change:
            obj.save(update_fields=["name"])
            return
        created = modelprofile_create(name=obj.name, **{f: getattr(obj, f) for f in self._layout})
        obj.pk, obj.model_key, obj.created_at = created.pk, created.model_key, created.created_at


class PlacementInline(admin.TabularInline):
    model = Placement
    extra = 0
    can_delete = False
    fields = ["tier", "node", "state", "epoch", "locator", "offset", "size_bytes", "checksum", "updated_at"]
    readonly_fields = ["tier", "node", "state", "epoch", "locator", "offset", "size_bytes", "checksum", "updated_at"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Block)
class BlockAdmin(admin.ModelAdmin):
    """Read-only: blocks are written by nodes and engines through the services."""

    list_display = [
        "prefix_key",
        "namespace",
        "model",
        "position",
        "token_count",
        "access_count",
        "last_access_at",
        "created_at",
    ]
    list_filter = ["namespace", "model"]
    list_select_related = ["namespace", "model"]
    search_fields = ["=prefix_key", "=content_key"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    inlines = [PlacementInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Block._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Placement)
class PlacementAdmin(admin.ModelAdmin):
    list_display = ["block", "tier", "node", "state", "epoch", "size_bytes", "updated_at"]
    list_filter = ["tier", "state", "node"]
    list_select_related = ["block", "node"]
    raw_id_fields = ["block"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Placement._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
