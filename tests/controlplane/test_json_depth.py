"""Deeply nested JSON is a 400 naming the nesting, not a 500: the API's parser bounds it (DRF's
own raises RecursionError), and the dashboard's websocket answers it like any unreadable frame."""

import copy
import json
import uuid

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, User
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.asgi import application
from controlplane.events import _redis, sequence_key
from controlplane.parsers import MAX_DEPTH, JSONParser, deeper_than
from controlplane.policies.models import Mode
from tests.directory.conftest import throttle_cache, user_with_role  # noqa: F401 - fixtures


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.fixture
def operator(db) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user_with_role('operator')).key}")
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [100_000, 1_000, MAX_DEPTH + 1])
def test_deep_nesting_is_a_400_naming_the_nesting(operator, depth):
    response = operator.post("/api/v1/modes/", data=nested(depth), content_type="application/json")
    assert response.status_code == 400, response.content[:200]
    assert response.json() == {"detail": f"JSON parse error - arrays and objects nested deeper than {MAX_DEPTH} levels"}


@pytest.mark.django_db
def test_deep_nesting_inside_a_real_body_is_refused_and_writes_nothing(operator):
    overrides = json.loads(nested(MAX_DEPTH))
    body = {"name": "deep", "kind": "custom", "overrides": {"tiers": overrides}}
    response = operator.post("/api/v1/modes/", data=body, format="json")
    assert response.status_code == 400
    assert "nested deeper than 64 levels" in response.json()["detail"]
    assert not Mode.objects.filter(name="deep").exists()


@pytest.mark.django_db
def test_ordinary_bodies_still_parse(operator):
    body = {"name": "shallow", "overrides": {"tiers": [{"tier": "disk", "ttl_seconds": 60}]}}
    response = operator.post("/api/v1/modes/", data=body, format="json")
    assert response.status_code == 201, response.json()


def test_the_limit_counts_arrays_and_objects_alike():
    assert not deeper_than(json.loads(nested(MAX_DEPTH)), MAX_DEPTH)
    assert deeper_than(json.loads(nested(MAX_DEPTH + 1)), MAX_DEPTH)
    mixed = json.loads('{"a": [{"b": [1, "x", {"c": []}]}]}')  # 6 levels
    assert not deeper_than(mixed, 6) and deeper_than(mixed, 5)
    assert not deeper_than(7, 0) and not deeper_than("[[[", 0)


def test_the_parser_answers_recursion_with_a_parse_error():
    import io

    from rest_framework.exceptions import ParseError

    with pytest.raises(ParseError, match="nested deeper than 64 levels"):
        JSONParser().parse(io.BytesIO(nested(100_000).encode()))
    assert JSONParser().parse(io.BytesIO(b'{"a": [1, 2]}')) == {"a": [1, 2]}


@pytest.fixture
def private_stream(settings):
    """A channel layer namespace of this test's own (as in test_dashboard_consumer.py)."""
    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    layers["default"]["CONFIG"]["prefix"] = f"test-{uuid.uuid4().hex[:10]}"
    settings.CHANNEL_LAYERS = layers
    yield
    _redis().delete(sequence_key())


def _session_cookie() -> bytes:
    username = f"op-{uuid.uuid4().hex[:6]}"
    user = User.objects.create_user(username=username, password="pw-op-123")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client = Client()
    assert client.login(username=username, password="pw-op-123")
    return f"sessionid={client.cookies['sessionid'].value}".encode()


@pytest.mark.django_db(transaction=True)
async def test_a_deeply_nested_websocket_frame_gets_an_error_and_keeps_the_stream(private_stream):
    cookie = await database_sync_to_async(_session_cookie)()
    communicator = WebsocketCommunicator(
        application, "/ws/dashboard/", headers=[(b"origin", b"http://testserver"), (b"cookie", cookie)]
    )
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    assert (await communicator.receive_json_from(timeout=5))["type"] == "hello"
    await communicator.send_to(text_data=nested(2048))  # 4096 bytes, the most a frame may carry
    assert (await communicator.receive_json_from(timeout=5))["type"] == "error"
    await communicator.send_json_to({"type": "ping"})
    assert await communicator.receive_json_from(timeout=5) == {"type": "pong"}
    await communicator.disconnect()
