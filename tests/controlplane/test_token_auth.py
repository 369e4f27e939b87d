"""Token authentication reads the user's groups with the token: one query decides who is asking and
what they may do, and nothing about a user is kept from one request to the next."""

import uuid

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.directory.services import modelprofile_create, namespace_create

LOOKUP = "/api/v1/blocks/lookup/"


def _client(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def _body(model_key: uuid.UUID) -> dict:
    return {"namespace": "auth-ns", "model_key": str(model_key), "prefix_keys": [str(uuid.uuid4())]}


@pytest.fixture
def model_key(db) -> uuid.UUID:
    namespace_create(name="auth-ns")
    return modelprofile_create(
        name="auth-model", model_id="t/m", layers=2, kv_heads=1, head_dim=8, dtype="float32", block_tokens=16
    ).model_key


@pytest.mark.django_db
def test_a_lookup_reads_the_token_user_and_groups_in_one_query(model_key):
    user = User.objects.create_user(username="engine")
    user.groups.add(Group.objects.get(name="operator"), Group.objects.get(name="viewer"))
    client = _client(user)
    with CaptureQueriesContext(connection) as queries:
        response = client.post(LOOKUP, _body(model_key), format="json")
    assert response.status_code == 200, response.content
    touching_groups = [q["sql"] for q in queries.captured_queries if "auth_user_groups" in q["sql"]]
    assert len(touching_groups) == 1, touching_groups
    assert "authtoken_token" in touching_groups[0]  # the token's own query, not one of its own


@pytest.mark.django_db
def test_roles_follow_group_changes_at_the_next_request(model_key):
    user = User.objects.create_user(username="engine")
    client = _client(user)
    # No group: authenticated, but no role.
    assert client.post(LOOKUP, _body(model_key), format="json").status_code == 403
    user.groups.add(Group.objects.get(name="viewer"))
    assert client.post(LOOKUP, _body(model_key), format="json").status_code == 200
    assert client.post("/api/v1/namespaces/", {"name": "nope"}, format="json").status_code == 403
    user.groups.add(Group.objects.get(name="operator"))
    assert client.post("/api/v1/namespaces/", {"name": "made"}, format="json").status_code == 201
    user.groups.clear()
    assert client.post(LOOKUP, _body(model_key), format="json").status_code == 403


@pytest.mark.django_db
def test_bad_tokens_and_inactive_users_are_refused(model_key):
    user = User.objects.create_user(username="engine")
    user.groups.add(Group.objects.get(name="operator"))
    client = _client(user)
    assert client.post(LOOKUP, _body(model_key), format="json").status_code == 200
    user.is_active = False
    user.save()
    response = client.post(LOOKUP, _body(model_key), format="json")
    assert response.status_code == 401 and "inactive" in response.json()["detail"]
    stranger = APIClient()
    stranger.credentials(HTTP_AUTHORIZATION="Token " + "0" * 40)
    response = stranger.post(LOOKUP, _body(model_key), format="json")
    assert response.status_code == 401 and response.json()["detail"] == "Invalid token."
    Token.objects.filter(user=user).delete()
    user.is_active = True
    user.save()
    assert client.post(LOOKUP, _body(model_key), format="json").status_code == 401  # the deleted token
