"""The three roles of the control plane and how a user's role is decided."""

from enum import IntEnum
from typing import cast

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, PermissionsMixin


class Role(IntEnum):
    """Ordered: each role can do what the roles below it can."""

    NONE = 0
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3


GROUP_NAMES = {Role.VIEWER: "viewer", Role.OPERATOR: "operator", Role.ADMIN: "admin"}


def role_of(user: AbstractBaseUser | AnonymousUser) -> Role:
    """A user's strongest role; superusers are admins, anonymous users have none."""
    if not user or not user.is_authenticated:
        return Role.NONE
    if getattr(user, "is_superuser", False):
        return Role.ADMIN
    # Token authentication loads the names with the token (accounts.authentication).
    names = getattr(user, "strata_group_names", None)
    if names is None:
        # Authenticated, so not AnonymousUser: the user model (auth.User) has groups.
        names = set(cast(PermissionsMixin, user).groups.values_list("name", flat=True))
    for role in (Role.ADMIN, Role.OPERATOR, Role.VIEWER):
        if GROUP_NAMES[role] in names:
            return role
    return Role.NONE
