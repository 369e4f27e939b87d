"""Writes for accounts: the role groups and the demo administrator."""

import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from controlplane.accounts.roles import GROUP_NAMES, Role


@transaction.atomic
def roles_ensure() -> list[Group]:
    """Create the viewer, operator and admin groups if missing."""
    return [Group.objects.get_or_create(name=name)[0] for name in GROUP_NAMES.values()]


@transaction.atomic
def admin_ensure(*, username: str, password: str | None, password_file: Path) -> tuple[str, bool]:
    """Make sure `username` is a superuser in the admin group.

    The password is `password` when given; otherwise the one kept in `password_file`, generated and
    written there (mode 600) the first time. Returns (password, created_now)."""
    if not password:
        if password_file.exists():
            password = password_file.read_text().strip()
        else:
            password = secrets.token_urlsafe(18)
            password_file.parent.mkdir(parents=True, exist_ok=True)
            password_file.write_text(password + "\n")
            password_file.chmod(0o600)
    user_model = get_user_model()
    user, created = user_model.objects.get_or_create(username=username, defaults={"is_staff": True})
    user.is_staff = True
    user.is_superuser = True
    user.set_password(password)
    user.save()
    user.groups.add(Group.objects.get_or_create(name=GROUP_NAMES[Role.ADMIN])[0])
    return password, created
