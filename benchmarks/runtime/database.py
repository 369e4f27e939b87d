"""Scratch databases for the suites that need their own (`directory`, `movements`, the `vllm`
suites): created on the configured PostgreSQL server, dropped afterwards (kept with
STRATA_BENCH_KEEP_DB=1), so two runs at once never touch each other's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote


def database_server() -> dict[str, Any]:
    """psycopg's connection arguments for the configured PostgreSQL server (DATABASE_URL, as the
    control plane reads it), without a database name."""
    from controlplane.runtime.environment import load_environment

    database = load_environment().database
    server = {
        "host": database.host or None,
        "port": database.port or None,
        "user": database.user or "postgres",
        "password": database.password or None,
        **database.options,
    }
    return {k: v for k, v in server.items() if v is not None}


@contextlib.contextmanager
def scratch_database(name: str) -> Iterator[str]:
    """A fresh database `name` on the configured server; yields its DATABASE_URL."""
    import psycopg

    server = database_server()
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    user = quote(server.get("user", "postgres"), safe="")
    password = quote(server.get("password", ""), safe="")
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = server.get("host", "")
    if host.startswith("/"):
        url = f"postgresql://{auth}/{name}?host={quote(host, safe='/')}"
    else:
        url = f"postgresql://{auth}{host or '127.0.0.1'}:{server.get('port', 5432)}/{name}"
    try:
        yield url
    finally:
        if os.environ.get("STRATA_BENCH_KEEP_DB") != "1":
            with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def django_child_env(url: str) -> dict[str, str]:
    """The environment of a suite's child process whose Django runs on the scratch database at
    `url` with the production settings (a throwaway secret key, no HTTPS redirect, warnings only)."""
    import secrets

    return {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.prod",
        "STRATA_SECRET_KEY": secrets.token_urlsafe(60),
        "STRATA_SSL_REDIRECT": "false",
        "STRATA_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
