"""The dashboard websocket: joins the dashboard group and forwards events; nothing else."""

from __future__ import annotations

import logging
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.dashboard.events import DASHBOARD_GROUP

log = logging.getLogger("strata.dashboard")

# Close codes in the application range (4000-4999), mirroring HTTP statuses.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_BAD_FRAME = 4400
MAX_FRAME_BYTES = 4096


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Streams dashboard events to a logged-in operator."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", "user": user.get_username()})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any) -> None:
        # The stream is one-way except for pings; anything else is refused with a reason.
        if bytes_data is not None or text_data is None or len(text_data) > MAX_FRAME_BYTES:
            await self.send_json({"type": "error", "error": "frames must be JSON text of at most 4096 bytes"})
            return
        await super().receive(text_data=text_data, **kwargs)

    @classmethod
    async def decode_json(cls, text_data: str) -> Any:
        import json

        try:
            return json.loads(text_data)
        except json.JSONDecodeError:
            return None

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})
        else:
            await self.send_json({"type": "error", "error": "unknown message; only {\"type\": \"ping\"} is accepted"})

    async def dashboard_event(self, message: dict[str, Any]) -> None:
        await self.send_json(message["event"])
