"""The dashboard websocket: joins the dashboard group and forwards its events, at most once a second.

Events arrive one by one from the channel layer, which may drop some. The consumer gathers them
into one `batch` frame per second at most: a node's heartbeats collapse into its latest one (each
carries the node's whole state), every other event is kept. A batch names the first and last
sequence number it saw and whether it saw every number in between; the page reloads the REST
snapshot whenever a batch is incomplete or does not follow the last one it applied.

A stream outlives no session: every SESSION_CHECK_S the consumer reads its session again, and a
session that was logged out, expired, or belongs to a user since deactivated, given a new
password or stripped of every role closes the stream (4401)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.utils.crypto import constant_time_compare

from controlplane.accounts.roles import Role, role_of
from controlplane.events import DASHBOARD_GROUP

log = logging.getLogger("strata.dashboard")

# Close codes in the application range (4000-4999), mirroring HTTP statuses.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_BAD_FRAME = 4400
CLOSE_TOO_MANY_FRAMES = 4429
MAX_FRAME_BYTES = 4096

FLUSH_INTERVAL_S = 1.0
"""Least time between two frames to one page: the live view's cadence."""
MAX_PENDING_EVENTS = 200
"""Events other than heartbeats held for one frame; beyond this the page is told to reload."""
SESSION_CHECK_S = 30.0
"""How often a stream's session is read again: a logged-out or expired session ends it within this."""
FRAME_BURST = 20
FRAMES_PER_SECOND = 5.0
"""A page sends a ping every few seconds; a client sending faster than this for long is cut off."""


def _coalesce_key(event: dict[str, Any]) -> tuple[str, Any]:
    if event.get("type") == "node.heartbeat" and isinstance(event.get("payload"), dict):
        return ("node.heartbeat", event["payload"].get("name"))
    return ("event", event.get("seq"))


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Streams dashboard events to a logged-in user with at least the viewer role."""

    async def connect(self) -> None:
        self.pending: dict[tuple[str, Any], dict[str, Any]] = {}
        self.seen: set[int] = set()
        self.overflowed = False
        self.flush_task: asyncio.Task[None] | None = None
        self.last_flush = 0.0
        self.allowance = float(FRAME_BURST)
        self.allowance_at = time.monotonic()
        self.joined = False
        self.session_task: asyncio.Task[None] | None = None
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        role = await database_sync_to_async(role_of)(user)
        if role < Role.VIEWER:
            log.info("dashboard stream refused to %s: the account has no role", user.get_username())
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        self.joined = True
        await self.accept()
        await self.send_json({"type": "hello", "user": user.get_username()})
        self.session_task = asyncio.create_task(self._watch_session(user.get_username()))

    async def disconnect(self, code: int) -> None:
        if getattr(self, "flush_task", None) is not None:
            self.flush_task.cancel()  # type: ignore[union-attr]
        if getattr(self, "session_task", None) is not None:
            self.session_task.cancel()  # type: ignore[union-attr]
        if getattr(self, "joined", False):
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    # -- the session ----------------------------------------------------------------------------
    async def _watch_session(self, username: str) -> None:
        while True:
            await asyncio.sleep(SESSION_CHECK_S)
            try:
                reason = await database_sync_to_async(self._session_ended)()
            except Exception as exc:  # noqa: BLE001 - the database is away: ask again next time
                log.warning("dashboard stream of %s: its session could not be read: %s", username, exc)
                continue
            if reason:
                log.info("dashboard stream of %s closed: %s", username, reason)
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return

    def _session_ended(self) -> str:
        """Why the stream's session no longer admits it ("" while it does), as Django's own
        authentication would decide on the next page load."""
        session = self.scope.get("session")
        key = getattr(session, "session_key", None)
        if session is None or not key:
            return "the stream has no session"
        data = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key).load()  # {}: logged out or expired
        user = self.scope["user"]
        if str(data.get(SESSION_KEY)) != str(user.pk):
            return "its session was logged out or expired"
        current = get_user_model().objects.filter(pk=user.pk, is_active=True).first()
        if current is None:
            return "the account is deactivated"
        if not constant_time_compare(str(data.get(HASH_SESSION_KEY, "")), current.get_session_auth_hash()):
            return "the account's password changed"
        if role_of(current) < Role.VIEWER:
            return "the account has no role any more"
        return ""

    # -- from the page -------------------------------------------------------------------------
    def _take_allowance(self) -> bool:
        now = time.monotonic()
        self.allowance = min(float(FRAME_BURST), self.allowance + (now - self.allowance_at) * FRAMES_PER_SECOND)
        self.allowance_at = now
        if self.allowance < 1.0:
            return False
        self.allowance -= 1.0
        return True

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any) -> None:
        if not self._take_allowance():
            log.warning(
                "dashboard stream of %s closed: more than %d frames at once",
                self.scope["user"].get_username(),
                FRAME_BURST,
            )
            await self.close(code=CLOSE_TOO_MANY_FRAMES)
            return
        # The stream is one-way except for pings; anything else is refused with a reason.
        if bytes_data is not None or text_data is None or len(text_data) > MAX_FRAME_BYTES:
            await self.send_json({"type": "error", "error": "frames must be JSON text of at most 4096 bytes"})
            return
        await super().receive(text_data=text_data, **kwargs)

    @classmethod
    async def decode_json(cls, text_data: str) -> Any:
        try:
            return json.loads(text_data)
        except (json.JSONDecodeError, RecursionError):  # 4096 bytes of `[` nest past Python's stack
            return None

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})
        else:
            await self.send_json({"type": "error", "error": 'unknown message; only {"type": "ping"} is accepted'})

    # -- from the channel layer ----------------------------------------------------------------
    async def dashboard_event(self, message: dict[str, Any]) -> None:
        event = message["event"]
        seq = event.get("seq")
        if isinstance(seq, int):
            self.seen.add(seq)
        key = _coalesce_key(event)
        if key[0] == "event" and len(self.pending) >= MAX_PENDING_EVENTS:
            # Too much at once for one frame: the page will reload the snapshot instead.
            self.overflowed = True
        elif key not in self.pending or self.pending[key].get("seq", 0) < (seq or 0):
            self.pending[key] = event
        if self.flush_task is None:
            delay = max(0.0, self.last_flush + FLUSH_INTERVAL_S - time.monotonic())
            self.flush_task = asyncio.get_running_loop().create_task(self._flush_after(delay))

    async def _flush_after(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        self.flush_task = None
        self.last_flush = time.monotonic()
        pending, seen, overflowed = self.pending, self.seen, self.overflowed
        self.pending, self.seen, self.overflowed = {}, set(), False
        first, last = (min(seen), max(seen)) if seen else (0, 0)
        complete = bool(seen) and not overflowed and len(seen) == last - first + 1
        frame: dict[str, Any] = {
            "type": "batch",
            "first": first,
            "last": last,
            "complete": complete,
            "events": [] if overflowed else sorted(pending.values(), key=lambda e: e["seq"]),
        }
        if overflowed:
            frame["reason"] = f"more than {MAX_PENDING_EVENTS} events within {FLUSH_INTERVAL_S:g} s"
        await self.send_json(frame)
