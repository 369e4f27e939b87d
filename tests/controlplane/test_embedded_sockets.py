"""The embedded PostgreSQL trusts its `postgres` user on its socket, so the sockets' directory
must admit only the account that runs Strata (and root): another local user cannot connect."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from django.conf import settings

pytestmark = pytest.mark.skipif(
    not settings.ENV.embedded_postgres, reason="DATABASE_URL names another PostgreSQL: nothing embedded to check"
)


SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter user `nobody` may run (the checkout's venv may sit where only its owner reads)."""


def test_the_socket_directory_admits_no_other_user():
    sockets = settings.ENV.database.host
    mode = os.stat(sockets).st_mode & 0o777
    assert mode & 0o007 == 0, f"{sockets} is mode {mode:o}: other users reach the trusted socket"
    if os.geteuid() != 0:
        return  # the mode above is the whole check: there is no other account to try as
    runuser = shutil.which("runuser")
    assert runuser and os.path.exists(SYSTEM_PYTHON), "runuser and python3 are needed to try the socket as another user"
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({os.path.join(sockets, '.s.PGSQL.5432')!r})\n"
        "except PermissionError:\n"
        "    sys.exit(13)\n"
    )
    result = subprocess.run(
        [runuser, "-u", "nobody", "--", SYSTEM_PYTHON, "-I", "-c", probe], capture_output=True, timeout=30
    )
    assert result.returncode == 13, result.stderr.decode()
