"""A node's own Redis user, against the real Redis: node A (its user from `strata_node_credential`)
consumes its own queue and writes L3 under its prefix, and cannot read node B's queue, send the
control plane's tasks, run FLUSHALL or CONFIG, or subscribe; rotation and revocation take effect
at once. A forged `node.apply_policies` changes nothing the directory does not say. Redis with an
eviction policy that drops any key is refused at start, naming the policy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
import redis.exceptions
from django.core.management import call_command

from controlplane.directory.errors import DirectoryError
from controlplane.directory.services.credentials import (
    node_credential_create,
    node_credential_revoke,
    node_credential_rotate,
)
from controlplane.runtime.environment import load_environment
from tests.support import RedisServer
from worker.dataplane.redis_policy import EvictingRedis, eviction_refusal, refuse_evicting

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _as(url: str, db: int | None = None) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_timeout=5)
    if db is not None:
        client.execute_command("SELECT", db)
    return client


def _denied(call, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(redis.exceptions.NoPermissionError):
        call(*args)


def test_a_nodes_user_reaches_its_queue_and_l3_and_nothing_else():
    a = node_credential_create(node="gpu-a", remote_prefix="l3a")
    node_credential_create(node="gpu-b", remote_prefix="l3a")
    assert "gpu-a" not in a.redis_url.split("@")[-1]  # the name and password ride in the URL's user part
    client = _as(a.redis_url)
    # Its own queue (a message in, a message out), its binding, its unacked keys, L3, the events.
    client.lpush("node.gpu-a", b"m")
    assert client.rpop("node.gpu-a") == b"m"
    client.lpush("node.gpu-a\x06\x163", b"m")
    client.delete("node.gpu-a\x06\x163")
    client.sadd("_kombu.binding.node.gpu-a", b"x")
    client.hset("node.gpu-a.unacked", "tag", "m")
    client.delete("node.gpu-a.unacked", "_kombu.binding.node.gpu-a")
    l3 = _as(a.redis_url, db=3)
    l3.set("l3a:blk:00", b"v")
    l3.hincrby("l3a:usage", "bytes", 1)
    l3.delete("l3a:blk:00", "l3a:usage")
    assert client.info("memory")["maxmemory_policy"]  # read at the node's start
    # Node B's queue (a node whose name starts like A's too), the control queue, the shared keys.
    _denied(client.lrange, "node.gpu-b", 0, -1)
    _denied(client.lpush, "node.gpu-b", b"forged")
    _denied(client.lpush, "node.gpu-a2", b"forged")
    _denied(client.lpush, "control", json.dumps({"task": "policies.mode_switch"}))
    _denied(client.hgetall, "unacked")
    _denied(client.get, "other:blk:00")
    # Admin and dangerous commands, pub/sub.
    _denied(client.flushall)
    _denied(client.flushdb)
    _denied(client.config_set, "maxmemory-policy", "allkeys-lru")
    _denied(client.keys, "*")
    _denied(client.execute_command, "ACL", "SETUSER", a.role, "+@all", "~*")
    _denied(client.publish, "/0.celeryev", b"x")  # no channel but remote control's
    _denied(client.lpush, "gpu-b@host.celery.pidbox", b"x")


def test_a_node_cannot_send_another_nodes_or_the_control_planes_tasks():
    from kombu import Connection, Exchange, Producer, Queue

    a = node_credential_create(node="gpu-a")
    env = load_environment({"REDIS_URL": a.redis_url})
    with Connection(env.redis.celery_url(env.redis.db)) as connection:
        producer = Producer(connection.channel())
        for queue in ("node.gpu-b", "control"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.publish(
                    {"version": 2**62, "classes": []},
                    exchange=Exchange(queue, type="direct"),
                    routing_key=queue,
                    declare=[Queue(queue, Exchange(queue, type="direct"), routing_key=queue)],
                )


def test_rotation_and_revocation_take_effect_at_once():
    first = node_credential_create(node="gpu-a")
    open_client = _as(first.redis_url)
    open_client.ping()
    second = node_credential_rotate(node="gpu-a")
    with pytest.raises(redis.exceptions.AuthenticationError):
        _as(first.redis_url).ping()
    _as(second.redis_url).ping()
    node_credential_revoke(node="gpu-a")
    with pytest.raises(redis.exceptions.AuthenticationError):
        _as(second.redis_url).ping()
    with pytest.raises(redis.exceptions.ConnectionError):  # its open connection was closed
        open_client.ping()


def test_a_bad_prefix_is_refused_by_name_and_creates_nothing():
    from controlplane.directory.models import NodeCredential

    with pytest.raises(DirectoryError, match=r"remote_prefix: 'l3\*' is not a key prefix"):
        node_credential_create(node="gpu-a", remote_prefix="l3*")
    assert not NodeCredential.objects.filter(node="gpu-a").exists()


def test_the_command_writes_both_urls_and_the_node_reads_them_from_files(tmp_path, capsys):
    call_command("strata_node_credential", "gpu-a", "--url-dir", str(tmp_path), "--remote-prefix", "l3a")
    redis_file = tmp_path / "gpu-a.redis.url"
    assert redis_file.stat().st_mode & 0o777 == 0o600
    env = load_environment({"REDIS_URL_FILE": str(redis_file), "DATABASE_URL_FILE": str(tmp_path / "gpu-a.url")})
    assert env.redis.auth.endswith("@") and env.redis.celery_url(0).startswith(f"redis+socket://{env.redis.auth}")
    _as(env.redis.url_for_db(3)).set("l3a:blk:01", b"v")
    err = capsys.readouterr().err
    assert "default user needs no password" in err  # the embedded Redis's default user is open


def test_a_forged_policy_message_applies_only_what_the_directory_holds():
    from controlplane.policies.snapshot import policies_snapshot
    from worker.dataplane.config import load_config
    from worker.node import NodeRuntime

    runtime = NodeRuntime(load_config(environ={}))
    held = policies_snapshot().version
    runtime.policies_announced(version=2**62)
    assert runtime.policy_version == held  # not 2**62: a later real version still applies
    runtime.policies_announced(version=held + 1)
    assert runtime.policy_version == held


@pytest.fixture
def evicting_redis(tmp_path):  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis")
    server.directory.mkdir()
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory", "64mb")
    client.config_set("maxmemory-policy", "allkeys-lru")
    yield server, client
    server.stop()


def test_a_redis_that_evicts_any_key_is_refused_by_name(evicting_redis, subprocess_env, python):
    server, client = evicting_redis
    with pytest.raises(EvictingRedis, match="maxmemory-policy is allkeys-lru"):
        refuse_evicting(client, "remote tier remote")
    client.config_set("maxmemory-policy", "volatile-lru")  # evicts only keys with an expiry
    assert eviction_refusal(client, "x") == ""
    client.config_set("maxmemory-policy", "allkeys-lfu")
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-e", "--allow-owner-credential"],
        cwd=REPO_ROOT,
        env={**subprocess_env, "REDIS_URL": server.url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "node gpu-e: REDIS_URL: Redis's maxmemory-policy is allkeys-lfu" in result.stderr
    result = subprocess.run(
        [python, "-c", "import django; django.setup(); import controlplane.asgi"],
        cwd=REPO_ROOT,
        env={**subprocess_env, "REDIS_URL": server.url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "maxmemory-policy is allkeys-lfu" in result.stderr
