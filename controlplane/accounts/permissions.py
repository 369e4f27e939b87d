"""Role-based API permission: viewers read, operators write, admins do admin-only actions."""

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from controlplane.accounts.roles import Role, role_of


class RolePermission(BasePermission):
    """Reads need `viewer`; writes need the view's `write_role` (default `operator`)."""

    message = "Your role does not allow this."

    def has_permission(self, request: Request, view: Any) -> bool:
        role = role_of(request.user)
        if request.method in SAFE_METHODS:
            needed = getattr(view, "read_role", Role.VIEWER)
        else:
            needed = getattr(view, "write_role", Role.OPERATOR)
        return role >= needed
