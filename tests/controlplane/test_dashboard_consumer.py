"""The dashboard websocket over the real channels-redis layer: who may connect, what arrives, how
events are batched at most once a second, and what a misbehaving client gets."""

import asyncio
import copy
import json
import uuid

import pytest
from channels.db import database_sync_to_async as sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, User
from django.test import Client

from controlplane.asgi import application
from controlplane.dashboard import consumers
from controlplane.dashboard.consumers import (
    CLOSE_FORBIDDEN,
    CLOSE_TOO_MANY_FRAMES,
    CLOSE_UNAUTHENTICATED,
    MAX_PENDING_EVENTS,
)
from controlplane.dashboard.selectors import overview_get
from controlplane.directory.services import TierReport, node_heartbeat, node_mark_down
from controlplane.events import _redis, event_validate, send_event_on_commit, sequence_key

pytestmark = [pytest.mark.django_db(transaction=True)]
ORIGIN = (b"origin", b"http://testserver")


@pytest.fixture(autouse=True)
def private_stream(settings):
    """A channel layer namespace (and so a sequence counter) of this test's own: events of other
    processes sharing the Redis never reach these consumers."""
    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    layers["default"]["CONFIG"]["prefix"] = f"test-{uuid.uuid4().hex[:10]}"
    settings.CHANNEL_LAYERS = layers
    yield
    _redis().delete(sequence_key())


def _session_cookie(username: str = "op", group: str | None = "operator") -> bytes:
    user = User.objects.create_user(username=username, password="pw-op-123")
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    client = Client()
    assert client.login(username=username, password="pw-op-123")
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def _connect(headers):
    communicator = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


async def _logged_in(username: str = "op", group: str | None = "operator"):
    cookie = await sync_to_async(_session_cookie)(username, group)
    communicator, connected, _ = await _connect([ORIGIN, (b"cookie", cookie)])
    assert connected
    assert await communicator.receive_json_from(timeout=5) == {"type": "hello", "user": username}
    return communicator


async def _frames_until(communicator, predicate, timeout=5.0):
    """Batches received until `predicate(all events so far)` holds; fails naming what was seen."""
    frames, events = [], []
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(events):
        remaining = deadline - asyncio.get_running_loop().time()
        assert remaining > 0, f"condition not met within {timeout}s; events seen: {[e['type'] for e in events]}"
        frame = await communicator.receive_json_from(timeout=remaining)
        assert frame["type"] == "batch", frame
        frames.append(frame)
        events.extend(frame["events"])
    return frames, events


def _announce(n: int, *, source: str = "test") -> None:
    for i in range(n):
        send_event_on_commit(
            kind="blocks.registered", payload={"blocks": i, "new": 0, "placements": 0, "source": source}
        )


def _fake_heartbeats(nodes: int, rounds: int) -> None:
    for r in range(rounds):
        for n in range(nodes):
            send_event_on_commit(
                kind="node.heartbeat",
                payload={
                    "name": f"gpu-{n}",
                    "host": "h",
                    "address": "",
                    "state": "up",
                    "last_seen": f"round-{r}",
                    "heartbeat_seconds": 1.0,
                    "tiers": [{"tier": "host", "capacity_bytes": 100, "used_bytes": r, "available": True}],
                },
            )


# -- who may connect ---------------------------------------------------------------------------


async def test_anonymous_is_refused():
    communicator, connected, code = await _connect([ORIGIN])
    assert not connected
    assert code == CLOSE_UNAUTHENTICATED


async def test_foreign_origin_is_refused():
    cookie = await sync_to_async(_session_cookie)()
    communicator, connected, _ = await _connect([(b"origin", b"http://evil.example"), (b"cookie", cookie)])
    assert not connected


async def test_missing_origin_is_refused():
    cookie = await sync_to_async(_session_cookie)()
    communicator, connected, _ = await _connect([(b"cookie", cookie)])
    assert not connected


async def test_account_without_a_role_is_refused():
    cookie = await sync_to_async(_session_cookie)("nobody", None)
    communicator, connected, code = await _connect([ORIGIN, (b"cookie", cookie)])
    assert not connected
    assert code == CLOSE_FORBIDDEN


async def test_a_viewer_may_watch():
    communicator = await _logged_in("watcher", "viewer")
    await communicator.disconnect()


# -- what arrives ------------------------------------------------------------------------------


async def test_heartbeat_and_state_events_arrive_in_batches_with_sequence_numbers():
    communicator = await _logged_in()
    await sync_to_async(node_heartbeat)(
        name="gpu-ws",
        host="h",
        heartbeat_seconds=1.0,
        tiers=[TierReport(tier="device", capacity_bytes=100, used_bytes=40)],
    )
    await sync_to_async(node_mark_down)(name="gpu-ws")
    frames, events = await _frames_until(communicator, lambda ev: any(e["type"] == "node.state" for e in ev))
    for event in events:
        event_validate(event)
    heartbeat = next(e for e in events if e["type"] == "node.heartbeat")
    assert heartbeat["payload"]["name"] == "gpu-ws"
    assert heartbeat["payload"]["tiers"] == [
        {"tier": "device", "capacity_bytes": 100, "used_bytes": 40, "available": True}
    ]
    state = next(e for e in events if e["type"] == "node.state")
    assert state["payload"] == {"name": "gpu-ws", "state": "down", "previous": "up"}
    assert state["seq"] == heartbeat["seq"] + 1
    for frame in frames:
        assert frame["complete"] is True
        assert [e["seq"] for e in frame["events"]] == sorted(e["seq"] for e in frame["events"])
        assert (
            frame["first"]
            <= min(e["seq"] for e in frame["events"])
            <= max(e["seq"] for e in frame["events"])
            <= frame["last"]
        )
    assert frames[0]["first"] == heartbeat["seq"]
    await communicator.disconnect()


async def test_heartbeats_collapse_to_each_nodes_latest_and_frames_are_at_most_one_a_second():
    communicator = await _logged_in()
    await sync_to_async(_fake_heartbeats)(3, 20)
    frames, events = await _frames_until(
        communicator, lambda ev: sum(1 for e in ev if e["payload"]["last_seen"] == "round-19") == 3
    )
    # 60 heartbeats sent within well under a second: one frame for the first, one for the rest.
    assert len(frames) <= 2
    assert len(events) <= 6
    last = frames[-1]
    assert last["complete"] is True
    assert {e["payload"]["name"]: e["payload"]["tiers"][0]["used_bytes"] for e in last["events"]} == {
        "gpu-0": 19,
        "gpu-1": 19,
        "gpu-2": 19,
    }
    assert frames[0]["first"] + 59 == last["last"]
    await communicator.disconnect()


async def test_a_lost_event_makes_the_batch_incomplete():
    communicator = await _logged_in()
    # The first event goes out at once; the next ones gather for the following frame.
    await sync_to_async(_announce)(1)
    await _frames_until(communicator, lambda ev: len(ev) == 1)
    await sync_to_async(_announce)(1)
    await sync_to_async(_redis().incr)(sequence_key())  # a number taken whose event never arrives
    await sync_to_async(_announce)(1)
    frames, events = await _frames_until(communicator, lambda ev: len(ev) == 2)
    assert len(frames) == 1
    assert frames[0]["complete"] is False
    assert frames[0]["last"] - frames[0]["first"] == 2
    await communicator.disconnect()


async def test_too_many_events_at_once_tell_the_page_to_reload():
    communicator = await _logged_in()
    await sync_to_async(_announce)(1)
    await _frames_until(communicator, lambda ev: len(ev) == 1)
    await sync_to_async(_announce)(MAX_PENDING_EVENTS + 50)
    frame = await communicator.receive_json_from(timeout=5)
    assert frame["type"] == "batch" and frame["complete"] is False and frame["events"] == []
    assert str(MAX_PENDING_EVENTS) in frame["reason"]
    await communicator.disconnect()


async def test_snapshot_sequence_number_covers_every_event_already_sent():
    communicator = await _logged_in()
    await sync_to_async(node_heartbeat)(
        name="gpu-snap",
        host="h",
        heartbeat_seconds=1.0,
        tiers=[TierReport(tier="host", capacity_bytes=1000, used_bytes=10)],
    )
    _, events = await _frames_until(communicator, lambda ev: any(e["type"] == "node.heartbeat" for e in ev))
    snapshot = await sync_to_async(overview_get)()
    assert snapshot["seq"] >= events[-1]["seq"]
    node = next(n for n in snapshot["nodes"] if n["name"] == "gpu-snap")
    assert node["tiers"][0]["used_bytes"] == 10
    await communicator.disconnect()


# -- misbehaving clients -----------------------------------------------------------------------


async def test_malformed_and_oversized_frames_get_an_error_and_keep_the_stream():
    communicator = await _logged_in()
    await communicator.send_to(text_data="{not json")
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    await communicator.send_to(text_data=json.dumps({"type": "ping", "pad": "x" * 5000}))
    assert "4096" in (await communicator.receive_json_from(timeout=5))["error"]
    await communicator.send_to(bytes_data=b"\x00\x01")
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    await communicator.send_json_to({"type": "subscribe", "to": "everything"})
    assert "only" in (await communicator.receive_json_from(timeout=5))["error"]
    await communicator.send_json_to({"type": "ping"})
    assert await communicator.receive_json_from(timeout=5) == {"type": "pong"}
    await communicator.disconnect()


async def test_a_flood_of_frames_closes_that_connection_only():
    flooder = await _logged_in("flooder")
    calm = await _logged_in("calm")
    for _ in range(consumers.FRAME_BURST * 5):
        await flooder.send_json_to({"type": "ping"})
    answers = []
    while True:
        message = await flooder.receive_output(timeout=5)
        if message["type"] == "websocket.close":
            assert message["code"] == CLOSE_TOO_MANY_FRAMES
            break
        answers.append(json.loads(message["text"]))
    assert 0 < len(answers) <= consumers.FRAME_BURST
    assert all(a == {"type": "pong"} for a in answers)
    await calm.send_json_to({"type": "ping"})
    assert await calm.receive_json_from(timeout=5) == {"type": "pong"}
    await sync_to_async(_announce)(1, source="after-flood")
    _, events = await _frames_until(calm, lambda ev: any(e["payload"].get("source") == "after-flood" for e in ev))
    await calm.disconnect()


async def test_a_slow_client_gets_few_frames_not_a_backlog():
    communicator = await _logged_in()
    # 5 nodes x 100 heartbeats while the client reads nothing for a while.
    await sync_to_async(_fake_heartbeats)(5, 100)
    await asyncio.sleep(2.5)
    frames = []
    while not await communicator.receive_nothing(timeout=1.5):
        frames.append(await communicator.receive_json_from(timeout=1))
    assert 1 <= len(frames) <= 4, [len(f["events"]) for f in frames]
    assert sum(len(f["events"]) for f in frames) <= 5 * len(frames)
    latest = {}
    for frame in frames:
        for event in frame["events"]:
            latest[event["payload"]["name"]] = event["payload"]["last_seen"]
    # Either every node's last heartbeat arrived, or a batch says something was lost (the page reloads).
    assert latest == {f"gpu-{n}": "round-99" for n in range(5)} or not all(f["complete"] for f in frames)
    await communicator.disconnect()


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="unknown event type 'node.exploded'"):
        send_event_on_commit(kind="node.exploded", payload={})


async def _closed_within(communicator, seconds: float) -> int:
    """The close code of a stream that ends within `seconds` (frames before it are skipped)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        message = await communicator.receive_output(timeout=max(0.1, deadline - asyncio.get_running_loop().time()))
        if message["type"] == "websocket.close":
            return message["code"]


def _end_session(username: str, how: str) -> None:
    from django.contrib.sessions.models import Session
    from django.utils import timezone

    user = User.objects.get(username=username)
    mine = [s for s in Session.objects.all() if str(s.get_decoded().get("_auth_user_id")) == str(user.pk)]
    assert mine, "the user's session should exist"
    if how == "logout":
        Session.objects.filter(pk__in=[s.pk for s in mine]).delete()
    elif how == "expired":
        Session.objects.filter(pk__in=[s.pk for s in mine]).update(expire_date=timezone.now())
    elif how == "deactivated":
        User.objects.filter(pk=user.pk).update(is_active=False)
    elif how == "password":
        user.set_password("a-new-password-456")
        user.save()
    elif how == "role":
        user.groups.clear()


@pytest.mark.parametrize("how", ["logout", "expired", "deactivated", "password", "role"])
async def test_a_stream_ends_once_its_session_does(monkeypatch, how):
    monkeypatch.setattr(consumers, "SESSION_CHECK_S", 0.2)
    ended = await _logged_in(f"leaver-{how}")
    staying = await _logged_in(f"stayer-{how}")
    await sync_to_async(_end_session)(f"leaver-{how}", how)
    assert await _closed_within(ended, 5) == CLOSE_UNAUTHENTICATED
    # Another user's stream keeps its session and its stream.
    await asyncio.sleep(0.5)
    await staying.send_json_to({"type": "ping"})
    assert await staying.receive_json_from(timeout=5) == {"type": "pong"}
    await staying.disconnect()
