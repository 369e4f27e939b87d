"""Ensure the operator account `admin` exists (password from STRATA_ADMIN_PASSWORD or generated)."""

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.accounts.services import admin_ensure, roles_ensure


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--username", default="admin")
        parser.add_argument("--quiet", action="store_true", help="do not print the password")

    def handle(self, *args: Any, username: str, quiet: bool, **options: Any) -> None:
        roles_ensure()
        password_file = Path(settings.VAR_DIR) / "admin-password"
        from_env = os.environ.get("STRATA_ADMIN_PASSWORD") or None
        had_file = password_file.exists()
        password, created = admin_ensure(username=username, password=from_env, password_file=password_file)
        if from_env:
            self.stdout.write(f"user {username}: password from STRATA_ADMIN_PASSWORD")
        elif not had_file and not quiet:
            # Printed once, when generated; afterwards it lives in the file only.
            self.stdout.write(f"user {username}: generated password {password} (kept in {password_file})")
        else:
            self.stdout.write(f"user {username}: password in {password_file}")
