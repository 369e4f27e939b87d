"""Fixtures of the policies tests: API clients per role, nodes, and the built-in policies the
migrations seed (every test database starts with them as version 1)."""

from __future__ import annotations

import pytest

from controlplane.directory.services import TierReport, node_heartbeat
from tests.directory.conftest import api_as, throttle_cache, user_with_role  # noqa: F401 - fixtures

GiB = 1 << 30


def node_up(name: str, *, group: str | None = None, device: int = GiB, host: int = 8 * GiB):
    return node_heartbeat(
        name=name,
        host="host-" + name,
        heartbeat_seconds=5.0,
        group=group,
        tiers=[
            TierReport(tier="device", capacity_bytes=device, used_bytes=0),
            TierReport(tier="host", capacity_bytes=host, used_bytes=0),
        ],
    )


@pytest.fixture
def sent_tasks(monkeypatch):
    """The tasks the dispatch helper sends, as (name, kwargs, queue), instead of a broker: the
    tasks' consumers (planner, node workers) are tested with their own apps."""
    from controlplane.policies import dispatch

    calls: list[tuple[str, dict, str]] = []

    class Recorder:
        def send_task(self, name, kwargs=None, queue=None, **options):
            calls.append((name, kwargs, queue))

    monkeypatch.setattr(dispatch, "celery_app", Recorder)
    return calls
