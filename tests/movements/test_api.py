"""The movements REST API (role matrix, filters, pagination, bad input naming the field), the
metrics read from the tallies, and the dashboard events' schemas."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.events import EVENT_SCHEMAS, event_validate
from controlplane.movements.choices import MovementState
from controlplane.movements.models import Movement
from controlplane.movements.services import (
    checksum_failures_count,
    movement_finish,
    movement_start,
    movements_plan,
)
from controlplane.policies.snapshot import TierPolicySpec
from tests.movements.conftest import BLOCK_BYTES, node_report, snapshot

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db
ROLES = ("anonymous", "none", "viewer", "operator", "admin")


def client_as(role: str) -> APIClient:
    client = APIClient()
    if role == "anonymous":
        return client
    user = User.objects.create_user(username=f"u-{role}-{uuid.uuid4().hex[:6]}", password="pw")
    if role != "none":
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def ledger(db, make_blocks, monkeypatch):  # type: ignore[no-untyped-def]
    """Five host->disk moves planned on gpu-0 (the first done, the second failed), two TTL
    evictions on gpu-1; the policies in force are a fixed snapshot."""
    import controlplane.movements.services as services

    policy = snapshot(
        TierPolicySpec(tier="host", high_watermark=0.9, low_watermark=0.5, ttl_seconds=60, min_accesses=1)
    )
    monkeypatch.setattr(services, "policies_snapshot", lambda: policy)
    node_report("gpu-0", host=(10 * B, 10 * B), disk=(100 * B, 0))
    make_blocks(10, accesses=[1] * 10, ages=[0] * 10)
    node_report("gpu-1", host=(100 * B, 2 * B))
    make_blocks(2, node="gpu-1", ages=[3600, 3600])
    written = movements_plan(snapshot=policy, reason="watermark").written
    first, second = written[0], written[1]
    movement_start(movement_id=first, node="gpu-0")
    movement_finish(movement_id=first, state=MovementState.DONE, nbytes=B, duration_s=0.01)
    movement_start(movement_id=second, node="gpu-0")
    movement_finish(movement_id=second, state=MovementState.FAILED, error="tier disk is full")
    evictions = list(Movement.objects.filter(kind="evict").values_list("id", flat=True))
    for ident in evictions:
        movement_start(movement_id=ident, node="gpu-1")
        movement_finish(movement_id=ident, state=MovementState.DONE, nbytes=B)
    return {"first": first, "second": second, "evictions": evictions}


MATRIX = [
    ("get", "/api/v1/movements/", None, (401, 403, 200, 200, 200)),
    ("get", "/api/v1/movements/{first}/", None, (401, 403, 200, 200, 200)),
    ("post", "/api/v1/movements/run/", {"dry_run": True}, (401, 403, 403, 200, 200)),
    ("delete", "/api/v1/movements/{first}/", None, (401, 403, 403, 405, 405)),
]


@pytest.mark.parametrize(("method", "url", "body", "expected"), MATRIX)
def test_role_matrix(ledger, method, url, body, expected):
    for role, status in zip(ROLES, expected, strict=True):
        response = getattr(client_as(role), method)(url.format(**ledger), body, format="json")
        assert response.status_code == status, (role, response.content)


def test_filters_and_pagination(ledger):
    api = client_as("viewer")
    everything = api.get("/api/v1/movements/").json()["results"]
    assert len(everything) == 7
    assert [m["id"] for m in everything] == sorted((m["id"] for m in everything), reverse=True)
    assert {m["id"] for m in api.get("/api/v1/movements/?state=done").json()["results"]} == {
        ledger["first"],
        *ledger["evictions"],
    }
    assert [m["id"] for m in api.get("/api/v1/movements/?state=failed").json()["results"]] == [ledger["second"]]
    evicted = api.get("/api/v1/movements/?kind=evict&reason=ttl&node=gpu-1&src_tier=host&dst_tier=").json()["results"]
    assert sorted(m["id"] for m in evicted) == sorted(ledger["evictions"])
    assert {m["route"] for m in evicted} == {"host->evicted"}
    moves = api.get("/api/v1/movements/?src_tier=host&dst_tier=disk&ordering=id").json()["results"]
    assert len(moves) == 5 and moves[0]["id"] < moves[-1]["id"]
    one = api.get(f"/api/v1/movements/?block={moves[0]['block']}").json()["results"]
    assert [m["id"] for m in one] == [moves[0]["id"]]
    page = api.get("/api/v1/movements/?page_size=3").json()
    assert len(page["results"]) == 3 and page["next"]
    rest = api.get(page["next"]).json()
    assert len(rest["results"]) == 3
    detail = api.get(f"/api/v1/movements/{ledger['second']}/").json()
    assert detail["state"] == "failed" and detail["error"] == "tier disk is full"
    assert detail["policy_version"] == 7 and detail["reason"] == "watermark"
    assert api.get("/api/v1/movements/999999/").status_code == 404


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("state=lost", "state"),
        ("kind=teleport", "kind"),
        ("src_tier=tape", "src_tier"),
        ("block=zero", "block"),
        ("ordering=random", "ordering"),
        ("plan=nope", "plan"),
    ],
)
def test_bad_filters_name_the_field(ledger, query, field):
    response = client_as("viewer").get(f"/api/v1/movements/?{query}")
    assert response.status_code == 400
    assert field in response.json()


def test_run_now_plans_and_answers_the_summary(ledger):
    api = client_as("operator")
    # Three moves are still in flight (3 blocks leaving): at a reported 10 blocks, gpu-0 counts as 7.
    dry = api.post("/api/v1/movements/run/", {"node": "gpu-0", "dry_run": True}, format="json").json()
    assert dry["dry_run"] is True and dry["written"] == 0 and dry["moves"] == 0
    node_report("gpu-0", host=(10 * B, 13 * B), disk=(100 * B, 0))  # the engine wrote more: 10 after them
    dry = api.post("/api/v1/movements/run/", {"node": "gpu-0", "dry_run": True}, format="json").json()
    assert dry["moves"] == 5 and dry["written"] == 0
    before = Movement.objects.count()
    real = api.post("/api/v1/movements/run/", {"node": "gpu-0"}, format="json").json()
    assert real["moves"] == 5 and real["written"] == 5
    assert real["by_route"] == {"host->disk": {"blocks": 5, "bytes": 5 * B}}
    assert Movement.objects.count() == before + 5
    assert Movement.objects.latest("id").reason == "manual"
    bad = api.post("/api/v1/movements/run/", {"node": "nowhere"}, format="json")
    assert bad.status_code == 400 and bad.json() == {"node": ["node: no node named 'nowhere'"]}
    bad = api.post("/api/v1/movements/run/", {"reason": "whim"}, format="json")
    assert bad.status_code == 400 and "reason" in bad.json()
    assert Movement.objects.count() == before + 5  # bad input wrote nothing


def test_warm_action_validates_its_input(ledger):
    api = client_as("operator")
    response = api.post("/api/v1/movements/warm/", {"node": "gpu-1", "limit": 0}, format="json")
    assert response.status_code == 400 and "limit" in response.json()
    response = api.post("/api/v1/movements/warm/", {"node": "gpu-1", "namespace": "ghost"}, format="json")
    assert response.status_code == 400 and response.json() == {"namespace": ["namespace: no namespace named 'ghost'"]}


def test_metrics_come_from_the_tallies(ledger, client):
    checksum_failures_count(tier="disk", count=2)
    text = client.get("/metrics").content.decode()
    assert 'strata_blocks_moved_total{dst_tier="disk",result="done",src_tier="host"} 1.0' in text
    assert 'strata_blocks_moved_total{dst_tier="disk",result="failed",src_tier="host"} 1.0' in text
    assert f'strata_bytes_moved_total{{dst_tier="disk",src_tier="host"}} {float(B)}' in text
    assert 'strata_evictions_total{reason="ttl",tier="host"} 2.0' in text
    assert 'strata_checksum_failures_total{found_by="scrub",tier="disk"} 2.0' in text


def test_event_schemas_match_what_the_services_send(ledger, django_capture_on_commit_callbacks, monkeypatch):
    import controlplane.events as events
    import controlplane.movements.services as services
    from controlplane.movements.services import movements_finished_announce

    sent = []
    monkeypatch.setattr(events, "_send", lambda kind, payload: sent.append((kind, payload)))
    dispatched = []
    monkeypatch.setattr(services, "movements_dispatch", lambda **kwargs: dispatched.append(kwargs["batches"]))
    node_report("gpu-0", host=(10 * B, 13 * B), disk=(100 * B, 0))

    with django_capture_on_commit_callbacks(execute=True):
        movements_plan(
            snapshot=snapshot(TierPolicySpec(tier="host", high_watermark=0.9, low_watermark=0.5)), node="gpu-0"
        )
        movements_finished_announce(node="gpu-0", done=3, failed=1, cancelled=0, nbytes=3 * B, routes={"host->disk": 3})
    assert [sorted(batch) for batch in dispatched] == [[("gpu-0", "move")]]  # sent on commit, one batch
    kinds = [k for k, _ in sent]
    assert kinds == ["movement.planned", "movement.finished"]
    for kind, payload in sent:
        event_validate({"type": kind, "seq": 1, "ts": 1.0, "payload": payload})
        assert set(payload) == set(EVENT_SCHEMAS[kind])
