"""Node heartbeats, stale detection and the read-only nodes API with its role matrix."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.directory.services import (
    TierReport,
    node_heartbeat,
    node_mark_down,
    nodes_mark_stale,
)
from controlplane.directory.tasks import nodes_mark_stale_task

TIERS = [
    TierReport(tier="device", capacity_bytes=8 << 30, used_bytes=1 << 30),
    TierReport(tier="host", capacity_bytes=32 << 30, used_bytes=0),
    TierReport(tier="disk", capacity_bytes=1 << 40, used_bytes=5 << 30),
    TierReport(tier="remote", capacity_bytes=0, used_bytes=0, available=False),
]


def beat(name="gpu-0", now=None, seconds=2.0, tiers=TIERS):
    return node_heartbeat(
        name=name, host="host-a", address="10.0.0.1:9000", heartbeat_seconds=seconds, tiers=list(tiers), now=now
    )


@pytest.mark.django_db
def test_heartbeat_upserts_node_and_tiers():
    beat()
    node = beat(tiers=[TierReport(tier="host", capacity_bytes=32 << 30, used_bytes=7)])
    node.refresh_from_db()
    assert node.heartbeats == 2 and node.state == NodeState.UP
    tiers = {t.tier: t for t in node.tiers.all()}
    assert set(tiers) == {"device", "host", "disk", "remote"}
    assert tiers["host"].used_bytes == 7
    assert tiers["remote"].available is False


@pytest.mark.django_db
def test_stale_after_three_missed_heartbeats_then_up_again():
    t0 = timezone.now()
    beat(now=t0, seconds=2.0)
    assert nodes_mark_stale(now=t0 + timedelta(seconds=5.9)) == []
    assert nodes_mark_stale(now=t0 + timedelta(seconds=6.1)) == ["gpu-0"]
    assert Node.objects.get(name="gpu-0").state == NodeState.STALE
    beat(now=t0 + timedelta(seconds=7), seconds=2.0)
    assert Node.objects.get(name="gpu-0").state == NodeState.UP


@pytest.mark.django_db
def test_beat_task_marks_stale_and_down_nodes_stay_down():
    beat(now=timezone.now() - timedelta(minutes=1), name="gpu-old")
    beat(name="gpu-new")
    beat(now=timezone.now() - timedelta(minutes=1), name="gpu-gone")
    node_mark_down(name="gpu-gone")
    assert nodes_mark_stale_task() == ["gpu-old"]
    states = dict(Node.objects.values_list("name", "state"))
    assert states == {"gpu-old": "stale", "gpu-new": "up", "gpu-gone": "down"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("report", "message"),
    [
        (dict(tier="gpu", capacity_bytes=1, used_bytes=0), "tier: unknown tier 'gpu'"),
        (dict(tier="host", capacity_bytes=-1, used_bytes=0), "capacity_bytes of tier host: cannot be negative"),
        (dict(tier="disk", capacity_bytes=1, used_bytes=-5), "used_bytes of tier disk: cannot be negative"),
    ],
)
def test_bad_tier_reports_are_refused_and_write_nothing(report, message):
    with pytest.raises(ValueError, match=message):
        beat(tiers=[TierReport(**report)])
    assert not Node.objects.exists()


@pytest.mark.django_db
def test_zero_heartbeat_interval_refused():
    with pytest.raises(ValueError, match="heartbeat_seconds"):
        beat(seconds=0)
    assert not Node.objects.exists()


def _user(role):
    user = User.objects.create_user(username=f"u-{role}", password="pw-" + role)
    if role == "superuser":
        user.is_superuser = True
        user.save()
    elif role != "none":
        user.groups.add(Group.objects.get(name=role))
    return user


# (role, expected status of GET /api/v1/nodes/, of POST /api/v1/nodes/)
ROLE_MATRIX = [
    ("anonymous", 401, 401),
    ("none", 403, 403),
    ("viewer", 200, 403),
    ("operator", 200, 405),
    ("admin", 200, 405),
    ("superuser", 200, 405),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("role", "read_status", "write_status"), ROLE_MATRIX)
def test_nodes_api_permissions(role, read_status, write_status):
    beat()
    client = APIClient()
    if role != "anonymous":
        token = Token.objects.create(user=_user(role))
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/v1/nodes/").status_code == read_status
    assert client.post("/api/v1/nodes/", {"name": "x"}, format="json").status_code == write_status
    assert client.get("/api/v1/nodes/gpu-0/").status_code == read_status


@pytest.mark.django_db
def test_nodes_api_lists_tiers_in_constant_queries(django_assert_max_num_queries):
    for i in range(12):
        beat(name=f"gpu-{i:02d}")
    client = APIClient()
    client.force_authenticate(_user("viewer"))
    with django_assert_max_num_queries(4):
        body = client.get("/api/v1/nodes/").json()
    assert [n["name"] for n in body["results"]] == [f"gpu-{i:02d}" for i in range(12)]
    first = body["results"][0]
    assert first["queue"] == "node.gpu-00"
    assert {t["tier"] for t in first["tiers"]} == {"device", "host", "disk", "remote"}


@pytest.mark.django_db
def test_unknown_node_is_404():
    client = APIClient()
    client.force_authenticate(_user("viewer"))
    assert client.get("/api/v1/nodes/nope/").status_code == 404


@pytest.mark.django_db
def test_schema_and_docs_served(admin_client):
    schema = admin_client.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/nodes/" in schema.content
    for path in ("/api/docs/", "/api/redoc/"):
        page = admin_client.get(path)
        assert page.status_code == 200
        # Swagger UI and ReDoc come from the installed sidecar package, never from a CDN.
        assert b"/static/drf_spectacular_sidecar/" in page.content and b"cdn.jsdelivr" not in page.content
        assert b"googleapis" not in page.content and "default-src 'self'" in page["Content-Security-Policy"]


@pytest.mark.django_db
def test_live_page_requires_login(client, admin_client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    page = admin_client.get("/")
    assert page.status_code == 200 and b'id="nodes"' in page.content
    assert b"live.js" in page.content
