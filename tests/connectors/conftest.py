"""A real vLLM (CPU backend) with and without StrataConnector, on a checkpoint saved here, with the
test run's PostgreSQL as the directory and a private Redis as the remote tier (a test stops it).

The engines take half a minute each to start, so a module shares them; what the tests write into
the directory is committed (vLLM's processes read it) and removed when the module ends."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import RedisServer, free_port, node_env

PAGES = 64
"""vLLM's KV space of these engines: 64 pages of 128 tokens (8192 tokens)."""
MAX_MODEL_LEN = 4096


@contextlib.contextmanager
def local_runtime(tmp_path: Path, shm_name: str, profile: Any, node: str, **overrides: str) -> Iterator[Any]:
    """A connector Runtime over a real host pool and disk tier (4 MiB / 8 MiB), no directory."""
    from worker.dataplane.config import load_config
    from worker.dataplane.connectors.vllm.runtime import Runtime
    from worker.dataplane.offload import OffloadManager
    from worker.dataplane.store import build_store

    config = load_config(
        overrides={
            "node_name": node,
            "tiers": "host,disk",
            "host_pool_name": shm_name,
            "host_bytes": "4MiB",
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes": "8MiB",
            **overrides,
        },
        environ={},
    )
    store = build_store(config, profile=profile, environ={})
    manager = OffloadManager(store=store, profile=profile, node=node, write_back_tier="host")
    try:
        yield Runtime(config=config, profile=profile, store=store, directory=None, manager=manager)
    finally:
        store.close()


def vllm_env(connection_settings: dict[str, Any], redis_url: str) -> dict[str, str]:
    """What vLLM's processes need to reach the test run's database and Redis."""
    host = connection_settings["HOST"]
    name, user, password = connection_settings["NAME"], connection_settings["USER"], connection_settings["PASSWORD"]
    if host.startswith("/"):
        url = f"postgresql://{user}:{password}@/{name}?host={host}"
    else:
        url = f"postgresql://{user}:{password}@{host}:{connection_settings['PORT'] or 5432}/{name}"
    return {
        "DATABASE_URL": url,
        "REDIS_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` while vLLM starts its processes (they inherit it)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclasses.dataclass
class Node:
    """The node a StrataConnector engine serves as, and the options it was given."""

    name: str
    extra: dict[str, Any]
    remote: RedisServer
    checkpoint: Path

    def config(self) -> Any:
        from worker.dataplane.connectors.vllm.runtime import node_options

        return node_options(self.extra)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from worker.dataplane.models.loading import save_preset

    return save_preset("small", tmp_path_factory.mktemp("checkpoint") / "small-ckpt")


@pytest.fixture(scope="module")
def directory_db(django_db_setup, django_db_blocker) -> Iterator[None]:
    """Committed access to the test database for the whole module (vLLM's processes write to it
    too); every table is emptied when the module ends."""
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        # pytest-django creates the test database only for sessions that collected a test marked
        # for it; run alone, this module's tests are not, and would write the configured database.
        created = None
        if connection.settings_dict["NAME"] != connection.creation._get_test_db_name():
            created = setup_databases(verbosity=0, interactive=False, aliases={"default"})
        try:
            yield
        finally:
            call_command("flush", interactive=False, verbosity=0)
            if created is not None:
                teardown_databases(created, verbosity=0)


@pytest.fixture(scope="module")
def node(directory_db, checkpoint) -> Iterator[Node]:
    from controlplane.directory.services import TierReport, namespace_ensure, node_heartbeat

    name = f"vllm-{uuid.uuid4().hex[:6]}"
    # Unix socket paths are limited to 107 bytes: not under pytest's temp root.
    work = Path(tempfile.mkdtemp(prefix="strata-vllm-"))
    remote = RedisServer(directory=work)
    try:
        remote.start()
        node_heartbeat(
            name=name,
            host="test",
            heartbeat_seconds=3600.0,
            tiers=[TierReport(tier=t, capacity_bytes=1 << 30, used_bytes=0) for t in ("host", "disk")],
        )
        for namespace in ("default", "tenant-a", "tenant-b"):
            namespace_ensure(name=namespace)
        extra = {
            "node_name": name,
            "tiers": "host,disk,remote",
            "host_pool_name": f"strata-test-{name}",
            "host_bytes": "64MiB",
            "disk_path": str(work / "disk"),
            "disk_bytes": "256MiB",
            "remote_url": remote.url,
            "remote_prefix": f"strata-test-{name}",
            "remote_bytes": "256MiB",
            "status_port": free_port(),
            "node_admin_key": f"admin-{name}",
            "client_namespaces": True,  # the tests name tenants' namespaces in kv_transfer_params
            # STRATA_TEST_BLEND=1: the same tests with fragment reuse on (prefix hits keep their exact path).
            "blend": os.environ.get("STRATA_TEST_BLEND") == "1",
        }
        yield Node(name=name, extra=extra, remote=remote, checkpoint=checkpoint)
    finally:
        remote.stop()
        shutil.rmtree(work, ignore_errors=True)
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink(missing_ok=True)


def _llm(checkpoint: Path, env: dict[str, str], transfer: Any = None) -> Any:
    from vllm import LLM

    with environment(env):
        return LLM(
            model=str(checkpoint),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            num_gpu_blocks_override=PAGES,
            kv_transfer_config=transfer,
            seed=0,
            disable_log_stats=False,
        )


@pytest.fixture(scope="module")
def vllm_environment(directory_db) -> dict[str, str]:
    from django.conf import settings
    from django.db import connection

    return vllm_env(connection.settings_dict, settings.ENV.redis.url)


@pytest.fixture(scope="module")
def plain(checkpoint, vllm_environment) -> Iterator[Any]:
    """vLLM alone: the reference every hit's tokens are compared with."""
    llm = _llm(checkpoint, vllm_environment)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def strata(node, vllm_environment) -> Iterator[Any]:
    """vLLM with StrataConnector (the control plane's: the directory on), serving as `node` on
    the node's own database credential."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="StrataConnector",
        kv_connector_module_path="worker.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=node.extra,
    )
    llm = _llm(node.checkpoint, node_env(vllm_environment, node.name), transfer)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def host_only_transfer(node_name: str, pool: str, **extra: Any) -> Any:
    """A KVTransferConfig of StrataConnector on the host tier alone (no directory): `extra` adds or
    overrides node options (`host_bytes` 8MiB and `block_tokens` 64 unless given)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="StrataConnectorBase",
        kv_connector_module_path="worker.dataplane.connectors.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "node_name": node_name,
            "tiers": "host",
            "host_pool_name": pool,
            "host_bytes": "8MiB",
            "block_tokens": 64,
            **extra,
        },
    )
