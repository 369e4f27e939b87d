"""Node liveness is judged on the database's clock: a node's own clock, however wrong, and the
interval it declares, however long, cannot keep it `up` after its heartbeats stop."""

import math
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.directory.services import TierReport, node_heartbeat, nodes_mark_stale

HOUR = timedelta(hours=1)


def beat_from_a_node_whose_clock_runs_ahead(monkeypatch, *, name: str, seconds: float) -> Node:
    """A heartbeat as the node's process sends it: the service runs there, on the node's clock."""
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + HOUR)
    try:
        return node_heartbeat(name=name, host="h", heartbeat_seconds=seconds, tiers=[TierReport("host", 1 << 20, 0)])
    finally:
        monkeypatch.setattr(timezone, "now", real_now)


def database_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


@pytest.mark.django_db
@pytest.mark.parametrize("first_beat", [True, False], ids=["new-node", "known-node"])
def test_a_node_an_hour_ahead_goes_stale_after_its_missed_heartbeats(monkeypatch, first_beat):
    if not first_beat:
        node_heartbeat(name="gpu-skew", host="h", heartbeat_seconds=0.2, tiers=[])
    node = beat_from_a_node_whose_clock_runs_ahead(monkeypatch, name="gpu-skew", seconds=0.2)
    # Stamped on receipt by the database, not an hour ahead by the node.
    assert abs((node.last_seen - database_now()).total_seconds()) < 5
    assert node.stale_after - node.last_seen == timedelta(seconds=0.6)
    assert nodes_mark_stale() == []
    time.sleep(0.7)  # three missed heartbeats of 0.2 s, on the database's clock
    assert nodes_mark_stale() == ["gpu-skew"]
    assert Node.objects.get(name="gpu-skew").state == NodeState.STALE


@pytest.mark.django_db
def test_a_row_claiming_life_beyond_the_longest_interval_is_stale():
    """A stale_after written on another clock (an older node's, or by hand over its own SQL
    grant) further ahead than any heartbeat could set is not believed."""
    node_heartbeat(name="gpu-forever", host="h", heartbeat_seconds=5, tiers=[])
    Node.objects.filter(name="gpu-forever").update(stale_after=timezone.now() + timedelta(days=3650))
    assert nodes_mark_stale() == ["gpu-forever"]
    node_heartbeat(name="gpu-forever", host="h", heartbeat_seconds=5, tiers=[])
    assert Node.objects.get(name="gpu-forever").state == NodeState.UP
    assert nodes_mark_stale() == []


@pytest.mark.django_db
@pytest.mark.parametrize("seconds", [0, 0.01, -5, 3601, 1e9, math.inf, math.nan])
def test_a_heartbeat_interval_out_of_range_is_refused_naming_it(seconds):
    with pytest.raises(ValueError, match=r"heartbeat_seconds: expected 0\.1 to 3600 seconds, got "):
        node_heartbeat(name="gpu-immortal", host="h", heartbeat_seconds=seconds, tiers=[])
    assert not Node.objects.filter(name="gpu-immortal").exists()


@pytest.mark.django_db
def test_the_longest_interval_allowed_still_ends():
    t0 = timezone.now()
    node_heartbeat(name="gpu-slow", host="h", heartbeat_seconds=3600, tiers=[], now=t0)
    assert nodes_mark_stale(now=t0 + timedelta(hours=2, minutes=59)) == []
    assert nodes_mark_stale(now=t0 + timedelta(hours=3, seconds=1)) == ["gpu-slow"]
