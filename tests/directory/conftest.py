"""Fixtures of the directory tests: namespaces, a model profile, nodes, API clients per role, and a
PostgreSQL server of a test's own."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import factory
import psycopg
import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.directory.models import Block, ModelProfile, Namespace, Node, Placement, salt_new
from controlplane.directory.services import TierReport, modelprofile_create, modelprofile_key, node_heartbeat
from controlplane.runtime.embedded import EmbeddedPostgres
from controlplane.runtime.environment import embedded_database_name, load_environment
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


@pytest.fixture
def private_var():
    """A var/ directory outside pytest's tmp_path: as root the server runs as another user, who
    must traverse every parent, and each pytest session resets pytest-of-<user> to mode 700
    (a test session started meanwhile by someone else would lock our server out)."""
    path = Path(tempfile.mkdtemp(prefix="strata-private-pg-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private_pg(private_var, db):
    """A PostgreSQL of this test's own (stopped and started at will), with the directory's tables,
    one namespace, one model profile and one node; yields (server, connect, model_key)."""
    server = EmbeddedPostgres(load_environment({"STRATA_VAR_DIR": str(private_var / "var")}))
    server.start()

    def connect():
        return psycopg.connect(
            host=str(server.sockets), dbname=embedded_database_name(), user="postgres", connect_timeout=2
        )

    try:
        # The tables as the models define them, created by plain SQL (no Django alias to register).
        with connection.schema_editor(collect_sql=True, atomic=False) as editor:
            for model in (Node, Namespace, ModelProfile, Block, Placement):
                editor.create_model(model)
        key, layout = modelprofile_key(
            model_id="m/private",
            layers=1,
            kv_heads=1,
            head_dim=8,
            dtype="float16",
            block_tokens=16,
            revision="main",
            rope_theta=10000.0,
            rope_scaling="",
        )
        with connect() as conn:
            for statement in editor.collected_sql:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO directory_namespace (name, salt, shared, description, created_at) "
                "VALUES ('tenant-a', %s, false, '', now())",
                (salt_new(),),
            )
            conn.execute(
                "INSERT INTO directory_modelprofile (name, model_id, revision, dtype, layers, kv_heads, "
                "head_dim, block_tokens, rope_theta, rope_scaling, model_key, created_at) VALUES "
                "('private', %(model_id)s, %(revision)s, %(dtype)s, %(layers)s, %(kv_heads)s, %(head_dim)s, "
                "%(block_tokens)s, %(rope_theta)s, %(rope_scaling)s, %(key)s, now())",
                {**layout, "key": key},
            )
            conn.execute(
                "INSERT INTO directory_node (name, host, address, state, version, heartbeat_seconds, "
                "heartbeats, registered_at, last_seen, stale_after) "
                "VALUES ('gpu-0', 'h', '', 'up', '', 5, 0, now(), now(), now())"
            )
        yield server, connect, key
    finally:
        server.stop()
