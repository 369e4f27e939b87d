"""Readiness checks: each returns None when healthy, or a sentence saying what failed."""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

from controlplane.runtime.redis_check import deployment_redis_refusal


def check_database() -> str | None:
    try:
        with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any driver error means "not ready"
        return f"database unreachable: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
    return None


def check_migrations() -> str | None:
    try:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as exc:  # noqa: BLE001
        return f"migrations cannot be checked: {type(exc).__name__}"
    if plan:
        return f"{len(plan)} migration(s) not applied, first {plan[0][0].app_label}.{plan[0][0].name}"
    return None


def check_redis() -> str | None:
    client = redis.Redis.from_url(settings.STRATA_REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return f"redis unreachable: {exc}"
    finally:
        client.close()
    return deployment_redis_refusal("readiness") or None


def readiness() -> dict[str, str | None]:
    """Every check by name; the database check gates the migrations check."""
    results: dict[str, str | None] = {"database": check_database(), "redis": check_redis()}
    results["migrations"] = check_migrations() if results["database"] is None else "skipped: database unreachable"
    return results
