"""The directory REST API: the role matrix as data, bad inputs, query-count baselines, admin pages."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User

from controlplane.directory.models import Block, ModelProfile, Namespace, Placement
from controlplane.directory.services import blocks_register, modelprofile_create
from tests.directory.conftest import NamespaceFactory

pytestmark = pytest.mark.django_db

ROLES = ("anonymous", "none", "viewer", "operator", "admin", "superuser")


@pytest.fixture
def world(registration, profile, namespace, node):
    """One registered block, an empty namespace and an unused profile (for the deletes)."""
    reg = registration()
    blocks_register(registrations=[reg])
    NamespaceFactory(name="empty")
    modelprofile_create(name="spare", model_id="strata/spare", layers=1, kv_heads=1, head_dim=8)
    block = Block.objects.get()
    return {
        "block": block.id,
        "key": str(reg.prefix_key),
        "content": str(reg.content_key),
        "model_key": str(profile.model_key),
    }


def _register_body(w, **block):
    return {
        "namespace": "tenant-a",
        "model_key": w["model_key"],
        "node": "gpu-0",
        "blocks": [
            {
                "prefix_key": str(uuid.uuid4()),
                "content_key": str(uuid.uuid4()),
                "position": 0,
                "token_count": 16,
                "size_bytes": 4096,
                "tier": "host",
                **block,
            }
        ],
    }


def _lookup_body(w):
    return {"namespace": "tenant-a", "model_key": w["model_key"], "node": "gpu-0", "prefix_keys": [w["key"]]}


# Endpoint x role -> status, one line per endpoint (the order of ROLES). Reads need viewer; a lookup
# is a read with a body; writes need operator; purging needs admin.
MATRIX = [
    ("get", "/api/v1/namespaces/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/namespaces/tenant-a/", None, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/namespaces/", lambda w: {"name": "new-ns"}, (401, 403, 403, 201, 201, 201)),
    ("patch", "/api/v1/namespaces/tenant-a/", lambda w: {"shared": True}, (401, 403, 403, 200, 200, 200)),
    ("put", "/api/v1/namespaces/tenant-a/", lambda w: {"shared": True}, (401, 403, 403, 405, 405, 405)),
    ("delete", "/api/v1/namespaces/empty/", None, (401, 403, 403, 204, 204, 204)),
    ("get", "/api/v1/model-profiles/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/model-profiles/tiny-llama/", None, (401, 403, 200, 200, 200, 200)),
    (
        "post",
        "/api/v1/model-profiles/",
        lambda w: {"name": "new-model", "model_id": "m/new", "layers": 4, "kv_heads": 2, "head_dim": 64},
        (401, 403, 403, 201, 201, 201),
    ),
    ("patch", "/api/v1/model-profiles/tiny-llama/", lambda w: {"layers": 3}, (401, 403, 403, 405, 405, 405)),
    ("delete", "/api/v1/model-profiles/spare/", None, (401, 403, 403, 204, 204, 204)),
    ("get", "/api/v1/blocks/", None, (401, 403, 200, 200, 200, 200)),
    ("get", "/api/v1/blocks/{block}/", None, (401, 403, 200, 200, 200, 200)),
    ("delete", "/api/v1/blocks/{block}/", None, (401, 403, 403, 405, 405, 405)),
    ("post", "/api/v1/blocks/lookup/", _lookup_body, (401, 403, 200, 200, 200, 200)),
    ("post", "/api/v1/blocks/register/", _register_body, (401, 403, 403, 200, 200, 200)),
    ("post", "/api/v1/blocks/purge/", lambda w: {"namespace": "tenant-a"}, (401, 403, 403, 403, 200, 200)),
    ("get", "/api/v1/nodes/", None, (401, 403, 200, 200, 200, 200)),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"), MATRIX, ids=[f"{m.upper()} {p}" for m, p, _, _ in MATRIX]
)
@pytest.mark.parametrize("role", ROLES)
def test_role_matrix(world, api_as, method, path, body, expected, role):
    client = api_as(role)
    url = path.format(**world)
    response = getattr(client, method)(url, body(world) if body else None, format="json")
    assert response.status_code == expected[ROLES.index(role)], response.content


def test_lookup_over_http_reports_hits_in_order(world, api_as):
    body = _lookup_body(world)
    missing = str(uuid.uuid4())
    body["prefix_keys"] = [world["key"], missing]
    body["content_keys"] = [world["content"]]
    answer = api_as("viewer").post("/api/v1/blocks/lookup/", body, format="json").json()
    assert answer["prefix_hit_blocks"] == 1 and answer["hits"] == 2
    first = answer["prefix"][0]
    assert first["key"] == world["key"] and first["tier"] == "host" and first["node"] == "gpu-0"
    assert first["token_count"] == 16 and first["epoch"] == 1
    assert answer["prefix"][1] is None
    assert answer["content"][0]["prefix_key"] == world["key"]


def test_register_over_http_is_idempotent(world, api_as):
    client = api_as("operator")
    body = _register_body(world)
    body["blocks"].append(
        {
            **body["blocks"][0],
            "prefix_key": str(uuid.uuid4()),
            "tier": "remote",
            "locator": "strata:x",
            "checksum": "0f" * 16,
        }
    )
    first = client.post("/api/v1/blocks/register/", body, format="json").json()
    assert first == {"blocks": 2, "new": 2, "placements": 2}
    again = client.post("/api/v1/blocks/register/", body, format="json").json()
    assert again == {"blocks": 2, "new": 0, "placements": 0}
    remote = Placement.objects.get(tier="remote")
    assert remote.node_id is None and remote.locator == "strata:x"


def test_salts_are_shown_to_operators_only(world, api_as):
    viewer = api_as("viewer").get("/api/v1/namespaces/tenant-a/").json()
    operator = api_as("operator").get("/api/v1/namespaces/tenant-a/").json()
    assert "salt" not in viewer
    assert operator["salt"] == Namespace.objects.get(name="tenant-a").salt


def test_block_list_filters_orders_and_pages(world, api_as, registration):
    blocks_register(
        registrations=[registration(position=16 * i) for i in range(1, 5)] + [registration(tier="remote", node=None)]
    )
    Block.objects.filter(position=32).update(access_count=50)
    client = api_as("viewer")
    hottest = client.get("/api/v1/blocks/", {"ordering": "-access_count", "page_size": 2}).json()
    assert hottest["results"][0]["position"] == 32 and len(hottest["results"]) == 2
    following = client.get(hottest["next"]).json()
    assert len(following["results"]) == 2
    remote = client.get("/api/v1/blocks/", {"tier": "remote"}).json()["results"]
    assert len(remote) == 1
    ready_on_node = client.get(
        "/api/v1/blocks/", {"node": "gpu-0", "state": "ready", "namespace": "tenant-a", "model": "tiny-llama"}
    ).json()["results"]
    assert len(ready_on_node) == 5
    assert client.get("/api/v1/blocks/", {"namespace": "tenant-b"}).json()["results"] == []
    oldest = client.get("/api/v1/blocks/", {"ordering": "created_at"}).json()["results"]
    assert oldest[0]["id"] == world["block"]


def test_block_detail_shows_copies_and_lifecycle(world, api_as):
    detail = api_as("viewer").get(f"/api/v1/blocks/{world['block']}/").json()
    assert detail["prefix_key"] == world["key"] and detail["namespace"] == "tenant-a"
    assert detail["model"] == "tiny-llama" and detail["access_count"] == 0
    assert {"created_at", "last_access_at", "priority"} <= set(detail)
    assert [(p["tier"], p["node"], p["state"], p["epoch"]) for p in detail["placements"]] == [
        ("host", "gpu-0", "ready", 1)
    ]
    assert api_as("viewer").get("/api/v1/blocks/999999999999999999/").status_code == 404


def test_purges_are_throttled(world, api_as):
    client = api_as("admin")
    codes = [client.post("/api/v1/blocks/purge/", {"namespace": "empty"}, format="json").status_code for _ in range(31)]
    assert codes == [200] * 30 + [429]


def test_purge_over_http(world, api_as):
    answer = api_as("admin").post(
        "/api/v1/blocks/purge/", {"namespace": "tenant-a", "model": "tiny-llama"}, format="json"
    )
    assert answer.json() == {"blocks": 1, "placements": 1}
    assert not Block.objects.exists()


def _assert_400(response, *path):
    assert response.status_code == 400, response.content
    errors = response.json()
    for step in path:
        assert step in errors, f"{step!r} not named in {errors}"
        errors = errors[step]
    return errors


def test_bad_lookups_are_400s_naming_the_field(world, api_as):
    client = api_as("viewer")
    body = _lookup_body(world)
    _assert_400(
        client.post("/api/v1/blocks/lookup/", {**body, "prefix_keys": [world["key"], "not-a-uuid"]}, format="json"),
        "prefix_keys",
        "1",
    )
    oversize = [str(uuid.uuid4()) for _ in range(4097)]
    _assert_400(client.post("/api/v1/blocks/lookup/", {**body, "prefix_keys": oversize}, format="json"), "prefix_keys")
    half = oversize[:2049]
    _assert_400(
        client.post("/api/v1/blocks/lookup/", {**body, "prefix_keys": half, "content_keys": half}, format="json"),
        "prefix_keys",
    )
    for field, value in [
        ("namespace", "nope"),
        ("model_key", str(uuid.uuid4())),
        ("node", "gpu-7"),
        ("model_key", "xyz"),
        ("namespace", "no spaces"),
    ]:
        message = _assert_400(client.post("/api/v1/blocks/lookup/", {**body, field: value}, format="json"), field)
        assert message
    _assert_400(client.post("/api/v1/blocks/lookup/", {"prefix_keys": []}, format="json"), "namespace")


def test_bad_registrations_are_400s_and_write_nothing(world, api_as):
    client = api_as("operator")
    before = (Block.objects.count(), Placement.objects.count())
    good = _register_body(world)["blocks"][0]

    def post(**changes):
        body = _register_body(world)
        body["blocks"] = [good, {**good, "prefix_key": str(uuid.uuid4()), **changes.pop("block", {})}]
        body.update(changes)
        return client.post("/api/v1/blocks/register/", body, format="json")

    _assert_400(post(block={"tier": "gpu"}), "blocks", "1", "tier")
    _assert_400(post(block={"size_bytes": -1}), "blocks", "1", "size_bytes")
    _assert_400(post(block={"position": -16}), "blocks", "1", "position")
    _assert_400(post(block={"offset": 2**63}), "blocks", "1", "offset")
    _assert_400(post(block={"token_count": 0}), "blocks", "1", "token_count")
    _assert_400(post(block={"prefix_key": "123"}), "blocks", "1", "prefix_key")
    _assert_400(post(block={"checksum": "XYZ"}), "blocks", "1", "checksum")
    _assert_400(post(node=None), "node")
    _assert_400(post(node="gpu-7"), "node")
    _assert_400(post(namespace="nope"), "namespace")
    _assert_400(post(model_key=str(uuid.uuid4())), "model_key")
    _assert_400(
        client.post("/api/v1/blocks/register/", {**_register_body(world), "blocks": []}, format="json"), "blocks"
    )
    too_many = {**_register_body(world), "blocks": [good] * 4097}
    _assert_400(client.post("/api/v1/blocks/register/", too_many, format="json"), "blocks")
    assert (Block.objects.count(), Placement.objects.count()) == before


def test_bad_list_queries_and_writes_are_400s(world, api_as):
    viewer, operator = api_as("viewer"), api_as("operator")
    _assert_400(viewer.get("/api/v1/blocks/", {"tier": "gpu"}), "tier")
    _assert_400(viewer.get("/api/v1/blocks/", {"ordering": "name"}), "ordering")
    _assert_400(viewer.get("/api/v1/blocks/", {"state": "lost"}), "state")
    assert viewer.get("/api/v1/blocks/", {"cursor": "garbage"}).status_code == 404
    profile = {"name": "p", "model_id": "m", "layers": 1, "kv_heads": 1, "head_dim": 8}
    _assert_400(operator.post("/api/v1/model-profiles/", {**profile, "layers": -1}, format="json"), "layers")
    _assert_400(operator.post("/api/v1/model-profiles/", {**profile, "dtype": "int4"}, format="json"), "dtype")
    _assert_400(
        operator.post(
            "/api/v1/model-profiles/",
            {
                **profile,
                "name": "q",
                "model_id": "strata/tiny-llama",
                "layers": 2,
                "kv_heads": 2,
                "head_dim": 16,
                "dtype": "float16",
                "block_tokens": 16,
            },
            format="json",
        ),
        "non_field_errors",  # the model id and the layout together are taken: no one field is wrong
    )
    _assert_400(operator.post("/api/v1/namespaces/", {"name": "tenant-a"}, format="json"), "name")
    _assert_400(operator.post("/api/v1/namespaces/", {"name": "bad name"}, format="json"), "name")
    in_use = operator.delete("/api/v1/namespaces/tenant-a/")
    assert in_use.status_code == 409 and "namespace" in in_use.json()
    assert operator.delete("/api/v1/model-profiles/tiny-llama/").status_code == 409
    assert ModelProfile.objects.filter(name="tiny-llama").exists()


# Query-count baselines (the token with its user's role, then the work); more rows must not mean
# more queries.
BASELINES = [
    ("get", "/api/v1/blocks/", None, 2),
    ("get", "/api/v1/blocks/?tier=host&node=gpu-0&ordering=-access_count", None, 2),
    ("get", "/api/v1/blocks/{block}/", None, 3),
    ("post", "/api/v1/blocks/lookup/", _lookup_body, 2),
    ("get", "/api/v1/namespaces/", None, 2),
    ("get", "/api/v1/model-profiles/", None, 2),
]


@pytest.mark.parametrize(("method", "path", "body", "queries"), BASELINES, ids=[p for _, p, _, _ in BASELINES])
def test_query_count_baselines(world, api_as, registration, django_assert_num_queries, method, path, body, queries):
    blocks_register(registrations=[registration(position=16 * i) for i in range(40)])
    for _i in range(5):
        NamespaceFactory()
    client = api_as("operator")
    url = path.format(**world)
    with django_assert_num_queries(queries):
        response = getattr(client, method)(url, body(world) if body else None, format="json")
    assert response.status_code == 200


def test_register_query_count_does_not_grow_with_the_batch(world, api_as, django_assert_max_num_queries):
    client = api_as("operator")
    body = _register_body(world)
    body["blocks"] = [{**body["blocks"][0], "prefix_key": str(uuid.uuid4())} for _ in range(500)]
    # token with role, savepoint, resolve, blocks, placements, release.
    with django_assert_max_num_queries(6):
        assert client.post("/api/v1/blocks/register/", body, format="json").status_code == 200


def test_admin_pages(world, admin_client):
    block = world["block"]
    for url in [
        "/admin/directory/namespace/",
        "/admin/directory/modelprofile/",
        "/admin/directory/block/",
        f"/admin/directory/block/{block}/change/",
        "/admin/directory/placement/",
        "/admin/directory/block/?q=not-a-uuid",
        f"/admin/directory/block/?q={world['key']}",
        "/admin/directory/modelprofile/add/",
        "/admin/directory/namespace/add/",
    ]:
        assert admin_client.get(url).status_code == 200, url
    created = admin_client.post(
        "/admin/directory/modelprofile/add/",
        {
            "name": "from-admin",
            "model_id": "m/admin",
            "revision": "main",
            "dtype": "float16",
            "layers": 2,
            "kv_heads": 2,
            "head_dim": 8,
            "block_tokens": 16,
            "rope_theta": 10000.0,
            "rope_scaling": "",
        },
    )
    assert created.status_code == 302, created.content[:2000]
    assert ModelProfile.objects.get(name="from-admin").model_key is not None
    assert User.objects.filter(is_superuser=True).exists()
