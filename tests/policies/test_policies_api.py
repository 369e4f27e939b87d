"""The policies REST API: the role matrix as data, every rule a 400 naming its field with nothing
changed, versions, diffs, rollback, mode switches, schedules, the dry run and the schema."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from controlplane.directory.models import Block
from controlplane.directory.services import (
    TierReport,
    blocks_register,
    modelprofile_create,
    node_heartbeat,
)
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)
from controlplane.policies.selectors import policy_state
from controlplane.policies.services import modeschedule_create
from worker.dataplane.directory import BlockRegistration

pytestmark = pytest.mark.django_db

ROLES = ("anonymous", "none", "viewer", "operator", "admin", "superuser")
HOST_POLICY = "/api/v1/tier-policies/{host}/"


@pytest.fixture
def world(db):
    schedule = modeschedule_create(mode="nightly-batch", cron="0 1 * * *")
    return {"host": TierPolicy.objects.get(tier="host", node_group="").pk, "schedule": schedule.pk}


def _class_body(w):
    return {"name": f"c-{uuid.uuid4().hex[:6]}", "device_share": 0.0}


def _tier_body(w):
    return {"tier": "disk", "node_group": f"g-{uuid.uuid4().hex[:6]}", "ttl_seconds": 3600}


def _mode_body(w):
    return {"name": f"m-{uuid.uuid4().hex[:6]}", "overrides": {"tiers": [{"tier": "disk", "ttl_seconds": 60}]}}


# Endpoint x role -> status, one line per endpoint (in the order of ROLES). Reads need viewer,
# writes (including switches, rollbacks and dry runs) need operator.
MATRIX = [
    ("get", "/api/v1/priority-classes/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/priority-classes/batch/", None, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/priority-classes/", _class_body, (401, 403, 403, 201, 201, 201)),
    ("patch", "/api/v1/priority-classes/batch/", lambda w: {"weight": 0.5}, (401, 403, 403, 200, 200, 200)),
    ("put", "/api/v1/priority-classes/batch/", lambda w: {"weight": 0.5}, (401, 403, 403, 405, 405, 405)),
    ("delete", "/api/v1/priority-classes/batch/", None, (401, 403, 403, 204, 204, 204)),
    ("get", "/api/v1/tier-policies/", None, (401, 403, 200, 200, 200, 200)),
    ("get", HOST_POLICY, None, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/tier-policies/", _tier_body, (401, 403, 403, 201, 201, 201)),
    ("patch", HOST_POLICY, lambda w: {"ttl_seconds": 600}, (401, 403, 403, 200, 200, 200)),
    ("delete", HOST_POLICY, None, (401, 403, 403, 204, 204, 204)),
    ("get", "/api/v1/modes/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/modes/long-doc/", None, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/modes/", _mode_body, (401, 403, 403, 201, 201, 201)),
    ("patch", "/api/v1/modes/long-doc/", lambda w: {"description": "x"}, (401, 403, 403, 200, 200, 200)),
    ("delete", "/api/v1/modes/long-doc/", None, (401, 403, 403, 204, 204, 204)),
    ("post", "/api/v1/modes/chat-peak/activate/", lambda w: {}, (401, 403, 403, 200, 200, 200)),
    ("get", "/api/v1/mode-schedules/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/mode-schedules/{schedule}/", None, (401, 403, 200, 200, 200, 200)),
    (
        "post",
        "/api/v1/mode-schedules/",
        lambda w: {"mode": "chat-peak", "cron": "0 8 * * *"},
        (401, 403, 403, 201, 201, 201),
    ),
    ("patch", "/api/v1/mode-schedules/{schedule}/", lambda w: {"enabled": False}, (401, 403, 403, 200, 200, 200)),
    ("delete", "/api/v1/mode-schedules/{schedule}/", None, (401, 403, 403, 204, 204, 204)),
    ("get", "/api/v1/policy-versions/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/policy-versions/1/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/policy-versions/1/diff/", None, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/policy-versions/1/rollback/", lambda w: {}, (401, 403, 403, 201, 201, 201)),
    ("delete", "/api/v1/policy-versions/1/", None, (401, 403, 403, 405, 405, 405)),
    ("post", "/api/v1/policies/dry-run/", lambda w: {}, (401, 403, 403, 200, 200, 200)),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"), MATRIX, ids=[f"{m.upper()} {p}" for m, p, _, _ in MATRIX]
)
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix(world, api_as, sent_tasks, method, path, body, expected, role):
    before = policy_state()
    versions = PolicyVersion.objects.count()
    response = getattr(api_as(role), method)(path.format(**world), body(world) if body else None, format="json")
    assert response.status_code == expected[ROLES.index(role)], response.content
    if response.status_code in (401, 403, 405):
        assert policy_state() == before and PolicyVersion.objects.count() == versions


# -- bad input: a 400 naming the field, and nothing changed ----------------------------------------

BAD = [
    ("patch", HOST_POLICY, {"low_watermark": 0.95}, "low_watermark"),
    ("patch", HOST_POLICY, {"high_watermark": 0.5}, "low_watermark"),
    ("patch", HOST_POLICY, {"capacity_bytes": -1}, "capacity_bytes"),
    ("patch", HOST_POLICY, {"algorithm": "random"}, "algorithm"),
    ("patch", HOST_POLICY, {"ttl_seconds": 0}, "ttl_seconds"),
    ("patch", HOST_POLICY, {"demote_tier": "device"}, "demote_tier"),
    ("patch", HOST_POLICY, {"high_watermark": "high"}, "high_watermark"),
    ("post", "/api/v1/tier-policies/", {"tier": "host", "capacity_bytes": -5}, "capacity_bytes"),
    ("post", "/api/v1/tier-policies/", {"tier": "host"}, "node_group"),
    ("post", "/api/v1/tier-policies/", {"tier": "tape"}, "tier"),
    ("post", "/api/v1/priority-classes/", {"name": "gold", "device_share": 0.2}, "device_share"),
    ("post", "/api/v1/priority-classes/", {"name": "gold"}, "device_share"),
    ("post", "/api/v1/priority-classes/", {"name": "gold", "device_share": 0, "weight": -1}, "weight"),
    ("post", "/api/v1/priority-classes/", {"name": "gold", "device_share": 0, "namespaces": ["a b"]}, "namespaces[0]"),
    ("patch", "/api/v1/priority-classes/batch/", {"device_share": 0.5}, "device_share"),
    (
        "post",
        "/api/v1/priority-classes/",
        {"name": "gold", "device_share": 0, "remote_write": "always"},
        "remote_write",
    ),
    ("patch", "/api/v1/priority-classes/batch/", {"remote_write": "write-back"}, "remote_write"),
    (
        "post",
        "/api/v1/modes/",
        {"name": "bad", "overrides": {"tiers": [{"tier": "host", "low_watermark": 0.95}]}},
        "overrides.tiers[0].low_watermark",
    ),
    (
        "post",
        "/api/v1/modes/",
        {"name": "bad", "overrides": {"classes": [{"name": "batch", "device_share": 0.9}]}},
        "overrides.classes[0].device_share",
    ),
    (
        "post",
        "/api/v1/modes/",
        {"name": "bad", "overrides": {"tiers": [{"tier": "disk", "capacity_bytes": -1}]}},
        "overrides.tiers[0].capacity_bytes",
    ),
    (
        "patch",
        "/api/v1/modes/long-doc/",
        {"overrides": {"tiers": [{"tier": "host", "algorithm": "fifo"}]}},
        "overrides.tiers[0].algorithm",
    ),
    ("post", "/api/v1/modes/", {"name": "long-doc"}, "name"),
    ("post", "/api/v1/modes/long-doc/deactivate/", {}, "name"),
    ("post", "/api/v1/mode-schedules/", {"mode": "chat-peak", "cron": "0 8 * * * *"}, "cron"),
    ("post", "/api/v1/mode-schedules/", {"mode": "chat-peak", "cron": "99 8 * * *"}, "cron"),
    ("post", "/api/v1/mode-schedules/", {"mode": "chat-peak", "cron": "0 8 * * someday"}, "cron"),
    ("post", "/api/v1/mode-schedules/", {"mode": "no-such", "cron": "0 8 * * *"}, "mode"),
    ("patch", "/api/v1/mode-schedules/{schedule}/", {"cron": "0 8 32 * *"}, "cron"),
    ("get", "/api/v1/policy-versions/1/diff/?against=42", None, "against"),
    (
        "post",
        "/api/v1/policies/dry-run/",
        {"tiers": [{"tier": "host", "low_watermark": 0.99}]},
        "overrides.tiers[0].low_watermark",
    ),
    (
        "post",
        "/api/v1/policies/dry-run/",
        {"tiers": [{"tier": "host", "capacity_bytes": -1}]},
        "overrides.tiers[0].capacity_bytes",
    ),
    ("post", "/api/v1/policies/dry-run/", {"nodes": []}, "overrides.nodes"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), BAD, ids=[f"{m} {p} {f}" for m, p, _, f in BAD])
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(world, api_as, sent_tasks, method, path, body, field):
    before = policy_state()
    beat = list(PeriodicTask.objects.values_list("name", "crontab_id", "enabled", "kwargs"))
    response = getattr(api_as("operator"), method)(path.format(**world), body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert policy_state() == before and PolicyVersion.objects.count() == 1
    assert list(PeriodicTask.objects.values_list("name", "crontab_id", "enabled", "kwargs")) == beat
    assert sent_tasks == []


def test_deleting_the_default_class_or_the_active_mode_is_a_conflict(world, api_as, sent_tasks):
    client = api_as("operator")
    assert client.delete("/api/v1/priority-classes/default/").status_code == 409
    client.post("/api/v1/modes/chat-peak/activate/", {}, format="json")
    response = client.delete("/api/v1/modes/chat-peak/")
    assert response.status_code == 409 and "name" in response.json()
    assert Mode.objects.filter(name="chat-peak", active=True).exists()


# -- versions, authors, diff, rollback -------------------------------------------------------------


def test_a_class_remote_write_is_versioned_sent_to_nodes_and_rolled_back(
    world, api_as, sent_tasks, django_capture_on_commit_callbacks
):
    client = api_as("operator")
    assert client.get("/api/v1/priority-classes/batch/").json()["remote_write"] == "on-demotion"
    with django_capture_on_commit_callbacks(execute=True):
        created = client.post(
            "/api/v1/priority-classes/",
            {"name": "shared", "device_share": 0.0, "namespaces": ["chat"], "remote_write": "write-through"},
            format="json",
        )
    assert created.status_code == 201, created.content
    assert created.json()["remote_write"] == "write-through"
    assert PriorityClass.objects.get(name="shared").remote_write == "write-through"
    diff = client.get("/api/v1/policy-versions/2/diff/").json()
    assert any(c["path"] == "classes.shared" and c["change"] == "added" for c in diff["changes"]), diff
    with django_capture_on_commit_callbacks(execute=True):
        client.patch("/api/v1/priority-classes/shared/", {"remote_write": "on-demotion"}, format="json")
    changes = client.get("/api/v1/policy-versions/3/diff/").json()["changes"]
    assert [(c["path"], c["before"], c["after"]) for c in changes] == [
        ("classes.shared.remote_write", "write-through", "on-demotion")
    ]
    client.post("/api/v1/policy-versions/2/rollback/", {}, format="json")
    assert PriorityClass.objects.get(name="shared").remote_write == "write-through"


def test_edits_record_their_author_and_versions_grow(world, api_as, sent_tasks):
    client = api_as("operator")
    response = client.patch(
        "/api/v1/priority-classes/batch/", {"device_share": 0.2, "comment": "more for chat"}, format="json"
    )
    assert response.status_code == 200 and response.json()["device_share"] == 0.2
    response = client.patch(HOST_POLICY.format(**world), {"ttl_seconds": 7200}, format="json")
    assert response.status_code == 200 and response.json()["ttl_seconds"] == 7200
    listing = client.get("/api/v1/policy-versions/").json()["results"]
    assert [v["number"] for v in listing] == [3, 2, 1]
    username = listing[0]["author"]
    assert username.startswith("u-operator-") and listing[1]["author"] == username
    assert listing[1]["comment"] == "more for chat"
    assert listing[0]["comment"] == "update tier policy host@fleet: ttl_seconds"
    detail = client.get("/api/v1/policy-versions/3/").json()
    assert detail["snapshot"] == policy_state()


def test_diff_names_each_changed_field(world, api_as, sent_tasks):
    client = api_as("operator")
    client.patch("/api/v1/priority-classes/batch/", {"device_share": 0.2, "namespaces": ["jobs"]}, format="json")
    client.post("/api/v1/modes/long-doc/activate/", {}, format="json")
    diff = client.get("/api/v1/policy-versions/3/diff/", {"against": 1}).json()
    assert diff["number"] == 3 and diff["against"] == 1
    assert {(c["path"], c["change"], str(c["before"]), str(c["after"])) for c in diff["changes"]} == {
        ("classes.batch.device_share", "changed", "0.3", "0.2"),
        ("classes.batch.namespaces", "changed", "[]", "['jobs']"),
        ("active_mode", "changed", "", "long-doc"),
    }
    previous = client.get("/api/v1/policy-versions/3/diff/").json()
    assert previous["against"] == 2 and [c["path"] for c in previous["changes"]] == ["active_mode"]
    first = client.get("/api/v1/policy-versions/1/diff/").json()
    assert first["against"] == 0 and {c["change"] for c in first["changes"]} == {"added"}


def test_rollback_over_rest_restores_and_is_a_new_version(world, api_as, sent_tasks):
    client = api_as("operator")
    seed = policy_state()
    client.post("/api/v1/priority-classes/", {"name": "gold", "device_share": 0.0, "weight": 4}, format="json")
    client.patch(HOST_POLICY.format(**world), {"high_watermark": 0.8, "low_watermark": 0.6}, format="json")
    client.post("/api/v1/modes/nightly-batch/activate/", {}, format="json")
    response = client.post("/api/v1/policy-versions/1/rollback/", {"comment": "back to the built-ins"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["number"] == 5 and body["action"] == "policy.rollback" and body["comment"] == "back to the built-ins"
    assert policy_state() == seed and body["snapshot"] == seed
    assert not PriorityClass.objects.filter(name="gold").exists()
    assert TierPolicy.objects.get(tier="host", node_group="").high_watermark == 0.9
    # The schedule of a mode the version also had is kept.
    assert ModeSchedule.objects.filter(pk=world["schedule"]).exists()
    assert client.post("/api/v1/policy-versions/99/rollback/", {}, format="json").status_code == 404


# -- modes and schedules ---------------------------------------------------------------------------


def test_mode_switch_over_rest(world, api_as, sent_tasks, django_capture_on_commit_callbacks):
    client = api_as("operator")
    with django_capture_on_commit_callbacks(execute=True):
        answer = client.post("/api/v1/modes/chat-peak/activate/", {"comment": "lunch peak"}, format="json")
    assert answer.status_code == 200 and answer.json() == {"mode": "chat-peak", "version": 2, "changed": True}
    assert client.get("/api/v1/modes/chat-peak/").json()["active"] is True
    with django_capture_on_commit_callbacks(execute=True):
        again = client.post("/api/v1/modes/chat-peak/activate/", {}, format="json").json()
    assert again == {"mode": "chat-peak", "version": 2, "changed": False}
    with django_capture_on_commit_callbacks(execute=True):
        switched = client.post("/api/v1/modes/long-doc/activate/", {}, format="json").json()
    assert switched["version"] == 3
    assert list(Mode.objects.filter(active=True).values_list("name", flat=True)) == ["long-doc"]
    with django_capture_on_commit_callbacks(execute=True):
        off = client.post("/api/v1/modes/long-doc/deactivate/", {}, format="json")
    assert off.status_code == 200 and off.json() == {"mode": "", "version": 4, "changed": True}
    assert not Mode.objects.filter(active=True).exists()
    assert PolicyVersion.objects.get(number=2).comment == "lunch peak"
    assert [reason["reason"] for name, reason, _ in sent_tasks if name == "movements.plan"] == ["mode-switch"] * 3
    assert client.post("/api/v1/modes/no-such/activate/", {}, format="json").status_code == 404


def test_a_mode_created_over_rest_stores_its_overrides_normalised(world, api_as, sent_tasks):
    client = api_as("operator")
    response = client.post(
        "/api/v1/modes/",
        {
            "name": "eval-run",
            "kind": "custom",
            "description": "evaluation sweep",
            "overrides": {
                "tiers": [{"tier": "disk", "ttl_seconds": 120.0}],
                "classes": [{"name": "batch", "weight": 0.1}],
            },
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["overrides"] == {
        "tiers": [{"tier": "disk", "node_group": "", "ttl_seconds": 120}],
        "classes": [{"name": "batch", "weight": 0.1}],
    }
    assert response.json()["active"] is False


def test_schedules_over_rest_own_their_beat_entries(world, api_as):
    client = api_as("operator")
    created = client.post("/api/v1/mode-schedules/", {"mode": "chat-peak", "cron": "0 9 * * mon-fri"}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["mode"] == "chat-peak" and body["enabled"] is True and body["author"].startswith("u-operator-")
    entry = PeriodicTask.objects.get(name=body["beat_entry"])
    assert entry.task == "policies.mode_switch" and entry.crontab.day_of_week == "mon-fri"
    client.patch(f"/api/v1/mode-schedules/{body['id']}/", {"enabled": False}, format="json")
    entry.refresh_from_db()
    assert entry.enabled is False
    assert client.delete(f"/api/v1/mode-schedules/{body['id']}/").status_code == 204
    assert not PeriodicTask.objects.filter(pk=entry.pk).exists()


# -- dry run ---------------------------------------------------------------------------------------

MiB = 1 << 20


@pytest.fixture
def full_host_tier(db):
    """One node whose host tier holds 40 blocks of 1 MiB in a 64 MiB pool (62%), idle for an hour,
    and a remote tier with room: over the normal host policy's high watermark (50% of the pool × 0.9)."""
    profile = modelprofile_create(name="tiny", model_id="strata/tiny", layers=1, kv_heads=1, head_dim=8)
    from controlplane.directory.services import namespace_create

    namespace_create(name="tenant-a")
    node_heartbeat(
        name="gpu-0",
        host="h",
        heartbeat_seconds=5.0,
        tiers=[
            TierReport(tier="host", capacity_bytes=64 * MiB, used_bytes=40 * MiB),
            TierReport(tier="remote", capacity_bytes=1024 * MiB, used_bytes=0),
        ],
    )
    blocks_register(
        registrations=[
            BlockRegistration(
                namespace="tenant-a",
                model_key=profile.model_key,
                prefix_key=uuid.uuid4(),
                content_key=uuid.uuid4(),
                position=16 * i,
                tokens=16,
                tier="host",
                node="gpu-0",
                nbytes=MiB,
                checksum="0" * 32,
            )
            for i in range(40)
        ]
    )
    Block.objects.update(last_access_at=timezone.now() - timedelta(hours=1), access_count=5)


def _movements_written() -> int:
    from controlplane.movements.models import Movement

    return Movement.objects.count()


@pytest.mark.skipif(
    not (Path(__file__).parents[2] / "controlplane/movements/planner.py").exists(),
    reason="the movements planner is not part of this tree",
)
def test_dry_run_shows_what_a_proposal_would_move_without_moving(full_host_tier, api_as, sent_tasks):
    client = api_as("operator")
    placements = list(Block.objects.values_list("placements__tier", "placements__epoch"))
    now = client.post("/api/v1/policies/dry-run/", {}, format="json")
    assert now.status_code == 200, now.content
    normal = now.json()
    assert normal["dry_run"] is True and normal["policy_version"] == 1
    # 40 MiB used, high = 64 × 0.5 × 0.9 = 28.8 MiB, low = 24 MiB: 16 blocks leave the host tier.
    assert normal["moves"] + normal["evictions"] == 16 and normal["bytes_moved"] + normal["bytes_evicted"] == 16 * MiB
    long_doc = client.post(
        "/api/v1/policies/dry-run/", Mode.objects.get(name="long-doc").overrides, format="json"
    ).json()
    assert long_doc["moves"] == long_doc["evictions"] == 0  # the larger host tier holds them all
    nightly = client.post(
        "/api/v1/policies/dry-run/", Mode.objects.get(name="nightly-batch").overrides, format="json"
    ).json()
    assert nightly["by_route"]["host->remote"]["blocks"] == 40  # all idle past the 15-minute TTL
    assert _movements_written() == 0
    assert list(Block.objects.values_list("placements__tier", "placements__epoch")) == placements
    assert PolicyVersion.objects.count() == 1 and sent_tasks == []
    unknown = client.post("/api/v1/policies/dry-run/?node=gpu-9", {}, format="json")
    assert unknown.status_code == 400 and "node" in unknown.json()


# -- schema ----------------------------------------------------------------------------------------

POLICY_PATHS = [
    "/api/v1/priority-classes/",
    "/api/v1/priority-classes/{name}/",
    "/api/v1/tier-policies/",
    "/api/v1/tier-policies/{id}/",
    "/api/v1/modes/",
    "/api/v1/modes/{name}/",
    "/api/v1/modes/{name}/activate/",
    "/api/v1/modes/{name}/deactivate/",
    "/api/v1/mode-schedules/",
    "/api/v1/mode-schedules/{id}/",
    "/api/v1/policy-versions/",
    "/api/v1/policy-versions/{number}/",
    "/api/v1/policy-versions/{number}/diff/",
    "/api/v1/policy-versions/{number}/rollback/",
    "/api/v1/policies/dry-run/",
    "/api/v1/namespace-quotas/",
    "/api/v1/namespace-quotas/{id}/",
    "/api/v1/namespace-quotas/usage/",
]


def test_schema_validates_and_lists_every_policies_endpoint(tmp_path):
    out = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    text = out.read_text()
    for path in POLICY_PATHS:
        assert f"  {path}:" in text, path
