"""The live event stream the dashboard shows: event schemas, sending after commit, sequence numbers.

Every app's services announce what they changed through `send_event_on_commit`, so this room sits
below all of them: it imports no app, and the dashboard app only reads from it (its consumer
forwards the group's events, its selectors read the current sequence number)."""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from prometheus_client import Counter

log = logging.getLogger("strata.dashboard")

DASHBOARD_EVENTS = Counter(
    "strata_dashboard_events_total", "Live dashboard events sent to the channel layer, by type.", ["type"]
)
DASHBOARD_EVENTS_LOST = Counter(
    "strata_dashboard_events_lost_total", "Live dashboard events that could not be sent (Redis unreachable).", ["type"]
)

DASHBOARD_GROUP = "dashboard"
SEQUENCE_KEY = "strata:dashboard:seq"

# Every event type and the fields its payload carries; a test checks real events against this.
EVENT_SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "node.heartbeat": {
        "name": str,
        "host": str,
        "address": str,
        "engine": str,
        "engine_address": str,
        "state": str,
        "last_seen": str,
        "heartbeat_seconds": (int, float),
        "tiers": list,
    },
    "node.state": {"name": str, "state": str, "previous": str},
    # One per registration batch (never per block), and one per purge.
    "blocks.registered": {"blocks": int, "new": int, "placements": int, "source": str},
    "blocks.purged": {"namespace": str, "model": str, "blocks": int, "placements": int},
    # One per policy version (edit, mode switch, rollback); mode.switched also when the active mode changes.
    "policy.changed": {"version": int, "action": str, "author": str, "comment": str, "mode": str},
    "mode.switched": {"mode": str, "previous": str, "version": int, "author": str},
    # One per switch load-following makes, with the measured traffic shape that made it.
    "mode.followed": {"mode": str, "previous": str, "version": int, "reason": str},
    # One per plan, and per node at most one a second for the movements it finished (never per block).
    "movement.planned": {
        "plan": str,
        "reason": str,
        "written": int,
        "moves": int,
        "evictions": int,
        "bytes": int,
        "policy_version": int,
        "mode": str,
    },
    "movement.finished": {"node": str, "done": int, "failed": int, "cancelled": int, "bytes": int, "routes": dict},
}


@lru_cache(maxsize=1)
def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.STRATA_REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def event_validate(event: dict[str, Any]) -> None:
    """Raise ValueError naming what is wrong with an event's envelope or payload."""
    for key, kind in (("type", str), ("seq", int), ("ts", float), ("payload", dict)):
        if not isinstance(event.get(key), kind):
            raise ValueError(f"event field {key!r} must be {kind.__name__}, got {event.get(key)!r}")
    schema = EVENT_SCHEMAS.get(event["type"])
    if schema is None:
        raise ValueError(f"unknown event type {event['type']!r}")
    for field, kinds in schema.items():
        if field not in event["payload"]:
            raise ValueError(f"{event['type']} payload lacks {field!r}")
        if not isinstance(event["payload"][field], kinds):
            raise ValueError(
                f"{event['type']} payload field {field!r} has type {type(event['payload'][field]).__name__}"
            )


def sequence_key() -> str:
    """The counter of the stream's sequence numbers: one per channel layer namespace, since the
    numbers are only meaningful to the consumers of that layer's dashboard group."""
    prefix = settings.CHANNEL_LAYERS["default"].get("CONFIG", {}).get("prefix", "asgi")
    return SEQUENCE_KEY if prefix == "asgi" else f"{SEQUENCE_KEY}:{prefix}"


def sequence_current() -> int:
    """The number of the latest event sent (0 before the first); snapshots carry it."""
    return int(_redis().get(sequence_key()) or 0)


def _send(kind: str, payload: dict[str, Any]) -> None:
    try:
        seq = int(_redis().incr(sequence_key()))
        event = {"type": kind, "seq": seq, "ts": time.time(), "payload": payload}
        async_to_sync(get_channel_layer().group_send)(DASHBOARD_GROUP, {"type": "dashboard.event", "event": event})
        DASHBOARD_EVENTS.labels(type=kind).inc()
    except (redis.RedisError, OSError) as exc:
        # The stream is lossy by design: the page re-reads the REST snapshot and catches up.
        DASHBOARD_EVENTS_LOST.labels(type=kind).inc()
        log.warning("dashboard event %s not sent: %s", kind, exc)


def send_event_on_commit(*, kind: str, payload: dict[str, Any]) -> None:
    """Queue a dashboard event to go out once the current transaction commits (at once outside one)."""
    if kind not in EVENT_SCHEMAS:
        raise ValueError(f"unknown event type {kind!r}")
    transaction.on_commit(lambda: _send(kind, payload))
