"""Fixtures of the directory tests: namespaces, a model profile, nodes and API clients per role."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import factory
import pytest
from django.contrib.auth.models import Group, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.directory.models import ModelProfile, Namespace, Node
from controlplane.directory.services import TierReport, modelprofile_create, node_heartbeat
from worker.dataplane.directory import BlockRegistration


@pytest.fixture(autouse=True)
def throttle_cache(monkeypatch):  # type: ignore[no-untyped-def]
    """Each test counts requests against rate limits afresh: the Redis cache outlives test runs,
    and user ids restart with every test database."""
    from django.core.cache.backends.locmem import LocMemCache
    from rest_framework.throttling import SimpleRateThrottle

    cache = LocMemCache(f"throttle-{uuid.uuid4().hex}", {})
    monkeypatch.setattr(SimpleRateThrottle, "cache", cache)
    return cache


class NamespaceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Namespace

    name = factory.Sequence(lambda n: f"tenant-{n}")


@pytest.fixture
def namespace(db) -> Namespace:  # type: ignore[no-untyped-def]
    return NamespaceFactory(name="tenant-a")


@pytest.fixture
def other_namespace(db) -> Namespace:  # type: ignore[no-untyped-def]
    return NamespaceFactory(name="tenant-b")


@pytest.fixture
def profile(db) -> ModelProfile:  # type: ignore[no-untyped-def]
    return modelprofile_create(
        name="tiny-llama",
        model_id="strata/tiny-llama",
        layers=2,
        kv_heads=2,
        head_dim=16,
        dtype="float16",
        block_tokens=16,
    )


def node_create(name: str) -> Node:
    return node_heartbeat(
        name=name,
        host="host-" + name,
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier="host", capacity_bytes=1 << 30, used_bytes=0)],
    )


@pytest.fixture
def node(db) -> Node:  # type: ignore[no-untyped-def]
    return node_create("gpu-0")


@pytest.fixture
def other_node(db) -> Node:  # type: ignore[no-untyped-def]
    return node_create("gpu-1")


@pytest.fixture
def registration(namespace, profile, node) -> Callable[..., BlockRegistration]:  # type: ignore[no-untyped-def]
    """Build a registration in tenant-a for the tiny profile; keyword arguments override."""

    def build(**overrides: object) -> BlockRegistration:
        fields: dict[str, object] = dict(
            namespace=namespace.name,
            model_key=profile.model_key,
            prefix_key=uuid.uuid4(),
            content_key=uuid.uuid4(),
            position=0,
            tokens=16,
            tier="host",
            node=node.name,
            nbytes=profile.block_bytes,
            checksum="0" * 32,
        )
        fields.update(overrides)
        return BlockRegistration(**fields)  # type: ignore[arg-type]

    return build


def user_with_role(role: str) -> User:
    user = User.objects.create_user(username=f"u-{role}-{uuid.uuid4().hex[:6]}", password="pw")
    if role == "superuser":
        user.is_superuser = True
        user.save()
    elif role != "none":
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


@pytest.fixture
def api_as(db) -> Callable[[str], APIClient]:  # type: ignore[no-untyped-def]
    """A token-authenticated API client for a role ('anonymous' gets no token)."""

    def build(role: str) -> APIClient:
        client = APIClient()
        if role != "anonymous":
            token = Token.objects.create(user=user_with_role(role))
            client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        return client

    return build
