"""Directory writes about nodes: heartbeats (with their tiers' reports) and node states."""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.db.models.expressions import Combinable
from django.db.models.functions import Now

from controlplane.directory.choices import NodeState, TierLevel
from controlplane.directory.models import Node, NodeTier, NodeTraffic
from controlplane.events import send_event_on_commit
from worker.dataplane.directory import ENGINES
from worker.dataplane.traffic import TrafficSummary


@dataclasses.dataclass(frozen=True)
class TierReport:
    """One tier as a node reports it."""

    tier: str
    capacity_bytes: int
    used_bytes: int
    available: bool = True

    def __post_init__(self) -> None:
        if self.tier not in TierLevel.values:
            raise ValueError(f"tier: unknown tier {self.tier!r}; expected one of {', '.join(TierLevel.values)}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes of tier {self.tier}: cannot be negative")
        if self.used_bytes < 0:
            raise ValueError(f"used_bytes of tier {self.tier}: cannot be negative")


def node_payload(node: Node) -> dict[str, object]:
    """The node as the dashboard and the API show it."""
    return {
        "name": node.name,
        "host": node.host,
        "address": node.address,
        "engine": node.engine,
        "engine_address": node.engine_address,
        "state": node.state,
        "last_seen": node.last_seen.isoformat(),
        "heartbeat_seconds": node.heartbeat_seconds,
        "tiers": [
            {"tier": t.tier, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "available": t.available}
            for t in sorted(node.tiers.all(), key=lambda t: TierLevel.values.index(t.tier))
        ],
    }


@transaction.atomic
def node_heartbeat(
    *,
    name: str,
    host: str,
    address: str = "",
    pid: int | None = None,
    version: str = "",
    heartbeat_seconds: float,
    tiers: list[TierReport],
    group: str | None = None,
    engine: str = "strata",
    engine_address: str = "",
    traffic: TrafficSummary | None = None,
    now: datetime | None = None,
) -> Node:
    """Record a heartbeat: upsert the node and its tiers, bring a stale node back up. `group` (the
    node's group for tier policies) is kept as it was when not given; a new node starts in "default".
    `engine` names what serves the model (strata or vllm) and `engine_address` that engine's own
    server where it is not Strata's. `traffic` (the node's recent requests) replaces the one stored
    before; a node that sends none keeps no traffic row, so load-following leaves it out.

    The heartbeat is stamped with the database's clock, never the caller's: this runs in the node's
    process, and a node whose clock runs an hour ahead must not stay `up` an hour after it died.
    `now` is for tests and the control plane's own callers; a node never passes it."""
    low, high = settings.STRATA_HEARTBEAT_MIN_SECONDS, settings.STRATA_HEARTBEAT_MAX_SECONDS
    if not low <= heartbeat_seconds <= high:  # NaN and infinity fail this too
        raise ValueError(f"heartbeat_seconds: expected {low:g} to {high:g} seconds, got {heartbeat_seconds!r}")
    if group is not None and not re.fullmatch(r"[-a-zA-Z0-9_]{1,63}", group):
        raise ValueError(f"group: expected 1-63 letters, digits, '-' or '_', got {group!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    # The row and the database's clock in one query; a new node asks the clock on its own.
    row = Node.objects.select_for_update().filter(name=name).annotate(received_at=Now()).first()
    now = now or (row.received_at if row is not None else _database_now())
    node: Node | None = row
    previous = node.state if node else None
    stale_after = now + timedelta(seconds=heartbeat_seconds * settings.STRATA_STALE_AFTER_MISSED)
    if node is None:
        # Two processes of a new node may report at the same moment: one inserts, the other
        # waits for that insert and then updates the row.
        try:
            with transaction.atomic():
                node = Node.objects.create(
                    name=name,
                    registered_at=now,
                    host=host,
                    last_seen=now,
                    stale_after=stale_after,
                    heartbeat_seconds=heartbeat_seconds,
                )
        except IntegrityError:
            node = Node.objects.select_for_update().get(name=name)
            previous = node.state
    node.host = host
    node.address = address
    node.engine = engine
    node.engine_address = engine_address
    if group is not None:
        node.group = group
    node.pid = pid
    node.version = version
    node.heartbeat_seconds = heartbeat_seconds
    node.heartbeats = (node.heartbeats or 0) + 1
    node.last_seen = now
    node.stale_after = stale_after
    node.state = NodeState.UP
    node.save()
    NodeTier.objects.bulk_create(
        [
            NodeTier(
                node=node,
                tier=t.tier,
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                available=t.available,
                updated_at=now,
            )
            for t in tiers
        ],
        update_conflicts=True,
        unique_fields=["node", "tier"],
        update_fields=["capacity_bytes", "used_bytes", "available", "updated_at"],
    )
    if traffic is not None:
        NodeTraffic.objects.update_or_create(
            node=node,
            defaults={
                "window_seconds": traffic.window_seconds,
                "requests": traffic.requests,
                "prompt_tokens": traffic.prompt_tokens,
                "prompt_buckets": list(traffic.prompt_buckets),
                "queue_depth": traffic.queue_depth,
                "l1_pressure": traffic.l1_pressure,
                "updated_at": now,
            },
        )
    else:
        NodeTraffic.objects.filter(node=node).delete()
    if previous is not None and previous != NodeState.UP:
        send_event_on_commit(kind="node.state", payload={"name": name, "state": NodeState.UP, "previous": previous})
    send_event_on_commit(kind="node.heartbeat", payload=node_payload(node))
    return node


def _database_now() -> datetime:
    """The database's clock: the one every heartbeat is stamped with and judged by."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


@transaction.atomic
def nodes_mark_stale(*, now: datetime | None = None) -> list[str]:
    """Mark `stale` every up node whose heartbeats stopped (3 missed); returns their names.

    Judged on the database's clock (`now` is for tests), the one the heartbeats were stamped with.
    A node whose `stale_after` lies further ahead than the longest interval a heartbeat may declare
    was not written by a heartbeat on that clock (an older node's own clock, or a hand-made row):
    it counts as stale too, and its next heartbeat brings it back up."""
    at: datetime | Combinable = now or Now()
    longest = timedelta(seconds=settings.STRATA_HEARTBEAT_MAX_SECONDS * settings.STRATA_STALE_AFTER_MISSED)
    stale = list(
        Node.objects.select_for_update(skip_locked=True)
        .filter(Q(stale_after__lt=at) | Q(stale_after__gt=at + longest), state=NodeState.UP)
        .values_list("name", flat=True)
    )
    if stale:
        Node.objects.filter(name__in=stale).update(state=NodeState.STALE)
        for name in stale:
            send_event_on_commit(
                kind="node.state", payload={"name": name, "state": NodeState.STALE, "previous": NodeState.UP}
            )
    return stale


@transaction.atomic
def node_mark_down(*, name: str) -> bool:
    """A node that shuts down cleanly says so; returns False if the node is unknown."""
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is None:
        return False
    previous = node.state
    node.state = NodeState.DOWN
    node.save(update_fields=["state"])
    send_event_on_commit(kind="node.state", payload={"name": name, "state": NodeState.DOWN, "previous": previous})
    return True
