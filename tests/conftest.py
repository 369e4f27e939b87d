"""Test-wide fixtures: the real PostgreSQL and Redis (embedded unless DATABASE_URL/REDIS_URL say otherwise)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    from controlplane.runtime.embedded import services_start
    from controlplane.runtime.environment import load_environment

    services_start(load_environment())


@pytest.fixture
def subprocess_env(settings) -> Iterator[dict[str, str]]:  # type: ignore[no-untyped-def]
    """Environment for a child process (a node worker, manage.py) that must use the test database."""
    from django.db import connection

    params = connection.settings_dict
    host = params["HOST"]
    if host.startswith("/"):
        url = f"postgresql://{params['USER']}:{params['PASSWORD']}@/{params['NAME']}?host={host}"
    else:
        url = f"postgresql://{params['USER']}:{params['PASSWORD']}@{host}:{params['PORT'] or 5432}/{params['NAME']}"
    env = dict(os.environ)
    env.update(
        DATABASE_URL=url,
        REDIS_URL=settings.ENV.redis.url,
        DJANGO_SETTINGS_MODULE="controlplane.settings.test",
        PYTHONUNBUFFERED="1",
    )
    yield env


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A unique /dev/shm pool name; every pool starting with it is removed after the test."""
    name = f"strata-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    for pool in Path("/dev/shm").glob(f"{name}*"):
        pool.unlink(missing_ok=True)


@pytest.fixture
def python() -> str:
    return sys.executable
