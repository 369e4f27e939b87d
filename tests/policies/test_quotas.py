"""Namespace quotas: the model's rules, the REST endpoints (role matrix, bad input naming the field),
versioning, diff and rollback of quotas, their dispatch to the nodes, and the usage endpoint."""

from __future__ import annotations

import uuid

import pytest
from django.db import IntegrityError, transaction

from controlplane.directory.services import (
    TierReport,
    blocks_register,
    modelprofile_create,
    namespace_create,
    node_heartbeat,
)
from controlplane.policies.choices import QuotaTier
from controlplane.policies.errors import PolicyError
from controlplane.policies.models import NamespaceQuota, PolicyVersion
from controlplane.policies.quotas import namespacequota_create, namespacequota_delete, namespacequota_update
from controlplane.policies.selectors import policy_state, snapshot_current
from controlplane.policies.services import policy_rollback
from controlplane.policies.specs import QUOTA_TIERS, QuotaSpec
from worker.dataplane.directory import BlockRegistration

pytestmark = pytest.mark.django_db

ROLES = ("anonymous", "none", "viewer", "operator", "admin", "superuser")
MiB = 1 << 20
QUOTAS = "/api/v1/namespace-quotas/"


@pytest.fixture
def tenants(db):
    for name in ("tenant-a", "tenant-b"):
        namespace_create(name=name)
    quota = namespacequota_create(namespace="tenant-a", tier="host", bytes=64 * MiB)
    return {"quota": quota.pk}


# -- model -----------------------------------------------------------------------------------------


def test_quota_tiers_are_the_specs_tiers():
    assert tuple(QuotaTier.values) == QUOTA_TIERS


@pytest.mark.parametrize(
    ("values", "constraint"),
    [
        ({"namespace": "tenant-a", "tier": "host", "bytes": 0}, "namespacequota_bytes_positive"),
        ({"namespace": "tenant-a", "tier": "device", "bytes": 1}, "namespacequota_tier_known"),
        ({"namespace": "tenant-a", "tier": "host", "bytes": 5}, "namespacequota_namespace_tier_uniq"),
    ],
)
def test_the_database_refuses_what_the_services_refuse(tenants, values, constraint):
    with pytest.raises(IntegrityError, match=constraint), transaction.atomic():
        NamespaceQuota.objects.create(**values)


@pytest.mark.parametrize(
    ("values", "field", "words"),
    [
        ({"namespace": "tenant-b", "tier": "device", "bytes": MiB}, "tier", "unknown value 'device'"),
        ({"namespace": "tenant-b", "tier": "tape", "bytes": MiB}, "tier", "expected one of host, disk, remote"),
        ({"namespace": "tenant-b", "tier": "disk", "bytes": 0}, "bytes", "at least 1"),
        ({"namespace": "tenant-b", "tier": "disk", "bytes": -5}, "bytes", "at least 1"),
        ({"namespace": "tenant-b", "tier": "disk", "bytes": 2**63}, "bytes", "at most"),
        ({"namespace": "tenant-b", "tier": "disk", "bytes": 1.5}, "bytes", "whole number"),
        ({"namespace": "tenant-b", "tier": "disk", "bytes": True}, "bytes", "whole number"),
        ({"namespace": "tenant-z", "tier": "disk", "bytes": MiB}, "namespace", "no namespace named 'tenant-z'"),
        ({"namespace": "a b", "tier": "disk", "bytes": MiB}, "namespace", "letters, digits"),
        ({"namespace": "tenant-a", "tier": "host", "bytes": MiB}, "tier", "already has a host quota"),
    ],
)
def test_service_refusals_name_the_field_and_change_nothing(tenants, values, field, words):
    before = policy_state()
    with pytest.raises(PolicyError, match=words) as caught:
        namespacequota_create(**values)
    assert caught.value.field == field
    assert policy_state() == before and PolicyVersion.objects.count() == 2


# -- versioning ------------------------------------------------------------------------------------


def test_each_edit_is_a_version_the_snapshot_holds_and_rollback_restores(tenants, sent_tasks):
    quota = NamespaceQuota.objects.get(pk=tenants["quota"])
    assert PolicyVersion.objects.get(number=2).action == "namespace-quota.create"
    assert snapshot_current().quotas == (QuotaSpec(namespace="tenant-a", tier="host", bytes=64 * MiB),)
    assert snapshot_current().quota("tenant-a", "host") == 64 * MiB
    assert snapshot_current().quota("tenant-b", "host") is None

    namespacequota_update(quota=quota, bytes=32 * MiB, author="ops")
    namespacequota_create(namespace="tenant-b", tier="remote", bytes=MiB, comment="cap b in L3")
    third = PolicyVersion.objects.get(number=3)
    assert third.action == "namespace-quota.update" and third.author == "ops"
    assert third.comment == f"update quota tenant-a@host: bytes {64 * MiB} -> {32 * MiB}"
    assert PolicyVersion.objects.get(number=4).snapshot["quotas"] == [
        {"namespace": "tenant-a", "tier": "host", "bytes": 32 * MiB},
        {"namespace": "tenant-b", "tier": "remote", "bytes": MiB},
    ]
    namespacequota_delete(quota=quota)
    assert [q.namespace for q in snapshot_current().quotas] == ["tenant-b"]

    written = policy_rollback(version=2, author="ops")
    assert written.number == 6 and written.snapshot["quotas"] == [
        {"namespace": "tenant-a", "tier": "host", "bytes": 64 * MiB}
    ]
    assert list(NamespaceQuota.objects.values_list("namespace", "tier", "bytes")) == [("tenant-a", "host", 64 * MiB)]
    policy_rollback(version=1)
    assert not NamespaceQuota.objects.exists() and snapshot_current().quotas == ()


def test_a_quota_change_reaches_the_planner_and_every_node(tenants, sent_tasks, django_capture_on_commit_callbacks):
    node_heartbeat(name="gpu-0", host="h", heartbeat_seconds=5.0, tiers=[TierReport("host", 8 * MiB, 0)])
    quota = NamespaceQuota.objects.get(pk=tenants["quota"])
    with django_capture_on_commit_callbacks(execute=True):
        namespacequota_update(quota=quota, bytes=16 * MiB)
    names = [name for name, _, _ in sent_tasks]
    assert names == ["movements.plan", "node.apply_policies"]
    _, kwargs, queue = sent_tasks[1]
    assert queue == "node.gpu-0" and kwargs["version"] == 3
    assert kwargs["quotas"] == [{"namespace": "tenant-a", "tier": "host", "bytes": 16 * MiB}]


def test_the_diff_names_quota_changes(tenants, api_as, sent_tasks):
    client = api_as("operator")
    client.patch(f"{QUOTAS}{tenants['quota']}/", {"bytes": MiB}, format="json")
    client.post(QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": 2 * MiB}, format="json")
    diff = client.get("/api/v1/policy-versions/4/diff/", {"against": 2}).json()
    assert sorted((c["path"], c["change"], c["before"], c["after"]) for c in diff["changes"]) == [
        ("quotas.tenant-a@host.bytes", "changed", 64 * MiB, MiB),
        ("quotas.tenant-b@disk", "added", None, {"namespace": "tenant-b", "tier": "disk", "bytes": 2 * MiB}),
    ]
    client.delete(f"{QUOTAS}{tenants['quota']}/")
    removed = client.get("/api/v1/policy-versions/5/diff/").json()["changes"]
    assert [(c["path"], c["change"]) for c in removed] == [("quotas.tenant-a@host", "removed")]


# -- REST ------------------------------------------------------------------------------------------

MATRIX = [
    ("get", QUOTAS, None, (401, 403, 200, 200, 200, 200)),
    ("get", QUOTAS + "{quota}/", None, (401, 403, 200, 200, 200, 200)),
    ("get", QUOTAS + "usage/", None, (401, 403, 200, 200, 200, 200)),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": MiB}, (401, 403, 403, 201, 201, 201)),
    ("patch", QUOTAS + "{quota}/", {"bytes": MiB}, (401, 403, 403, 200, 200, 200)),
    ("put", QUOTAS + "{quota}/", {"bytes": MiB}, (401, 403, 403, 405, 405, 405)),
    ("delete", QUOTAS + "{quota}/", None, (401, 403, 403, 204, 204, 204)),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"), MATRIX, ids=[f"{m.upper()} {p}" for m, p, _, _ in MATRIX]
)
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix(tenants, api_as, sent_tasks, method, path, body, expected, role):
    before = policy_state()
    response = getattr(api_as(role), method)(path.format(**tenants), body, format="json")
    assert response.status_code == expected[ROLES.index(role)], response.content
    if response.status_code in (401, 403, 405):
        assert policy_state() == before and PolicyVersion.objects.count() == 2


BAD = [
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "device", "bytes": MiB}, "tier"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "nvme", "bytes": MiB}, "tier"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": 0}, "bytes"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": -1}, "bytes"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": 2**64}, "bytes"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk", "bytes": "lots"}, "bytes"),
    ("post", QUOTAS, {"namespace": "tenant-b", "tier": "disk"}, "bytes"),
    ("post", QUOTAS, {"namespace": "nobody", "tier": "disk", "bytes": MiB}, "namespace"),
    ("post", QUOTAS, {"tier": "disk", "bytes": MiB}, "namespace"),
    ("post", QUOTAS, {"namespace": "tenant-a", "tier": "host", "bytes": MiB}, "tier"),
    ("patch", QUOTAS + "{quota}/", {"bytes": 0}, "bytes"),
    ("patch", QUOTAS + "{quota}/", {"bytes": 2**63}, "bytes"),
    ("get", QUOTAS + "usage/?namespace=a%20b", None, "namespace"),
    ("get", QUOTAS + "usage/?namespace=nobody", None, "namespace"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), BAD, ids=[f"{m} {p} {f} {b}" for m, p, b, f in BAD])
def test_bad_input_is_a_400_naming_the_field(tenants, api_as, sent_tasks, method, path, body, field):
    before = policy_state()
    response = getattr(api_as("operator"), method)(path.format(**tenants), body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert policy_state() == before and PolicyVersion.objects.count() == 2 and sent_tasks == []


def test_crud_over_rest(tenants, api_as, sent_tasks):
    client = api_as("operator")
    created = client.post(
        QUOTAS, {"namespace": "tenant-b", "tier": "remote", "bytes": 8 * MiB, "comment": "b floods"}, format="json"
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert {k: body[k] for k in ("namespace", "tier", "bytes")} == {
        "namespace": "tenant-b",
        "tier": "remote",
        "bytes": 8 * MiB,
    }
    version = client.get("/api/v1/policy-versions/3/").json()
    assert version["action"] == "namespace-quota.create" and version["comment"] == "b floods"
    assert version["author"].startswith("u-operator-")
    listing = client.get(QUOTAS).json()["results"]
    assert [(q["namespace"], q["tier"]) for q in listing] == [("tenant-a", "host"), ("tenant-b", "remote")]
    changed = client.patch(f"{QUOTAS}{body['id']}/", {"bytes": 4 * MiB}, format="json").json()
    assert changed["bytes"] == 4 * MiB and NamespaceQuota.objects.get(pk=body["id"]).bytes == 4 * MiB
    assert client.delete(f"{QUOTAS}{body['id']}/").status_code == 204
    assert client.get(f"{QUOTAS}{body['id']}/").status_code == 404
    assert PolicyVersion.objects.count() == 5


# -- usage -----------------------------------------------------------------------------------------


def _register(profile, namespace: str, node: str, tier: str, count: int, nbytes: int) -> None:
    blocks_register(
        registrations=[
            BlockRegistration(
                namespace=namespace,
                model_key=profile.model_key,
                prefix_key=uuid.uuid4(),
                content_key=uuid.uuid4(),
                position=16 * i,
                tokens=16,
                tier=tier,
                node=node if tier != "remote" else None,
                nbytes=nbytes,
                checksum="0" * 32,
            )
            for i in range(count)
        ]
    )


def test_usage_per_namespace_per_tier_per_node(tenants, api_as, sent_tasks):
    profile = modelprofile_create(name="tiny", model_id="strata/tiny", layers=1, kv_heads=1, head_dim=8)
    for name in ("gpu-0", "gpu-1"):
        node_heartbeat(
            name=name,
            host="h",
            heartbeat_seconds=5.0,
            tiers=[TierReport("host", 1024 * MiB, 0), TierReport("remote", 1 << 40, 0)],
        )
    _register(profile, "tenant-a", "gpu-0", "host", 80, MiB)  # 80 MiB on gpu-0: over its 64 MiB
    _register(profile, "tenant-a", "gpu-1", "host", 10, MiB)
    _register(profile, "tenant-a", "gpu-1", "remote", 3, MiB)
    _register(profile, "tenant-b", "gpu-0", "host", 500, MiB)  # no quota: not listed by default
    namespacequota_create(namespace="tenant-a", tier="remote", bytes=10 * MiB)

    client = api_as("viewer")
    rows = client.get(QUOTAS + "usage/").json()
    assert rows == [
        {
            "namespace": "tenant-a",
            "tier": "host",
            "quota_bytes": 64 * MiB,
            "used_bytes": 80 * MiB,
            "over": True,
            "nodes": [
                {"node": "gpu-0", "used_bytes": 80 * MiB, "over": True},
                {"node": "gpu-1", "used_bytes": 10 * MiB, "over": False},
            ],
        },
        {
            "namespace": "tenant-a",
            "tier": "remote",
            "quota_bytes": 10 * MiB,
            "used_bytes": 3 * MiB,
            "over": False,
            "nodes": [{"node": "", "used_bytes": 3 * MiB, "over": False}],
        },
    ]
    b = client.get(QUOTAS + "usage/", {"namespace": "tenant-b"}).json()
    assert [(r["tier"], r["quota_bytes"], r["used_bytes"], r["over"]) for r in b] == [
        ("host", None, 500 * MiB, False),
        ("disk", None, 0, False),
        ("remote", None, 0, False),
    ]
