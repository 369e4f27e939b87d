"""The dashboard websocket over the real channels-redis layer: who may connect, and what arrives."""

import asyncio
import json

import pytest
from channels.db import database_sync_to_async as sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client

from controlplane.asgi import application
from controlplane.dashboard.consumers import CLOSE_UNAUTHENTICATED
from controlplane.dashboard.events import event_validate
from controlplane.directory.services import TierReport, node_heartbeat, node_mark_down

pytestmark = [pytest.mark.django_db(transaction=True)]


def _session_cookie() -> bytes:
    User.objects.create_user(username="op", password="pw-op-123")
    client = Client()
    assert client.login(username="op", password="pw-op-123")
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def _connect(headers):
    communicator = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


async def test_anonymous_is_refused():
    communicator, connected, code = await _connect([(b"origin", b"http://testserver")])
    assert not connected
    assert code == CLOSE_UNAUTHENTICATED


async def test_foreign_origin_is_refused():
    cookie = await sync_to_async(_session_cookie)()
    communicator, connected, _ = await _connect([(b"origin", b"http://evil.example"), (b"cookie", cookie)])
    assert not connected


async def _next_event(communicator, kind, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        assert remaining > 0, f"no {kind} event within {timeout}s"
        message = await communicator.receive_json_from(timeout=remaining)
        if message.get("type") == kind:
            return message


async def test_heartbeat_and_state_events_are_delivered_with_sequence_numbers():
    cookie = await sync_to_async(_session_cookie)()
    communicator, connected, _ = await _connect([(b"origin", b"http://testserver"), (b"cookie", cookie)])
    assert connected
    hello = await communicator.receive_json_from(timeout=5)
    assert hello == {"type": "hello", "user": "op"}

    await sync_to_async(node_heartbeat)(
        name="gpu-ws", host="h", heartbeat_seconds=1.0,
        tiers=[TierReport(tier="device", capacity_bytes=100, used_bytes=40)],
    )
    event = await _next_event(communicator, "node.heartbeat")
    event_validate(event)
    assert event["payload"]["name"] == "gpu-ws"
    assert event["payload"]["tiers"] == [
        {"tier": "device", "capacity_bytes": 100, "used_bytes": 40, "available": True}
    ]

    await sync_to_async(node_mark_down)(name="gpu-ws")
    state = await _next_event(communicator, "node.state")
    event_validate(state)
    assert state["payload"] == {"name": "gpu-ws", "state": "down", "previous": "up"}
    assert state["seq"] > event["seq"]
    await communicator.disconnect()


async def test_malformed_and_oversized_frames_get_an_error_and_keep_the_stream():
    cookie = await sync_to_async(_session_cookie)()
    communicator, connected, _ = await _connect([(b"origin", b"http://testserver"), (b"cookie", cookie)])
    assert connected
    await communicator.receive_json_from(timeout=5)
    await communicator.send_to(text_data="{not json")
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    await communicator.send_to(text_data=json.dumps({"type": "ping", "pad": "x" * 5000}))
    assert "4096" in (await communicator.receive_json_from(timeout=5))["error"]
    await communicator.send_to(bytes_data=b"\x00\x01")
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    await communicator.send_json_to({"type": "ping"})
    assert await communicator.receive_json_from(timeout=5) == {"type": "pong"}
    await communicator.disconnect()


def test_unknown_event_kind_is_refused():
    from controlplane.dashboard.events import send_event_on_commit

    with pytest.raises(ValueError, match="unknown event type 'node.exploded'"):
        send_event_on_commit(kind="node.exploded", payload={})
