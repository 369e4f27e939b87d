"""Namespaces inside a real vLLM OpenAI server: NamespaceMiddleware places each request by its tenant's
API key, the connector in vLLM's engine honours the namespace it vouched for and no client claim,
and a request without a tenant's key is refused by name."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "admin-key-of-the-tenancy-test"
KEYS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    from worker.dataplane.engine.models import save_preset
    from worker.vllm_server import NAMESPACE_MIDDLEWARE

    checkpoint = save_preset("small", tmp_path_factory.mktemp("checkpoint") / "small")
    port, status = free_port(), free_port()
    pool = f"strata-test-tenancy-{os.getpid()}"
    extra = {"node_name": "tenancy", "tiers": "host", "host_pool_name": pool, "host_bytes": "32MiB"}
    env = {
        **os.environ,
        "STRATA_API_KEYS": ",".join(f"{key}={namespace}" for key, namespace in KEYS.items()),
        "STRATA_NAMESPACE_SECRET": secrets.token_urlsafe(32),
        "STRATA_NODE_ADMIN_KEY": ADMIN,
        "STRATA_STATUS_PORT": str(status),
        "STRATA_BLOCK_TOKENS": "128",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "32",
        "--middleware",
        NAMESPACE_MIDDLEWARE,
        "--kv-transfer-config",
        json.dumps(
            {
                "kv_connector": "StrataConnectorBase",
                "kv_connector_module_path": "worker.dataplane.connectors.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        ),
    ]
    log = tempfile.NamedTemporaryFile(prefix="vllm-tenancy-", suffix=".log", delete=False)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vLLM exited at start: {Path(log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as answer:  # no key needed
                    model = json.loads(answer.read())["data"][0]["id"]
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield {"base": base, "model": model, "status": f"http://127.0.0.1:{status}"}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        for path in Path("/dev/shm").glob(f"{pool}*"):
            path.unlink(missing_ok=True)
        os.unlink(log.name)


def complete(server: dict[str, Any], key: str | None, **body: Any) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    payload = {"model": server["model"], "prompt": list(range(3, 3 + 200)), "max_tokens": 1, **body}
    request = urllib.request.Request(
        server["base"] + "/v1/completions", data=json.dumps(payload).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def newest_namespace(server: dict[str, Any]) -> str:
    request = urllib.request.Request(
        server["status"] + "/v1/strata/requests?limit=1", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(json.loads(answer.read())["requests"][0]["namespace"])


def test_a_tenant_s_key_places_its_requests_and_a_claim_changes_nothing(server):
    assert complete(server, "key-of-a")[0] == 200
    assert newest_namespace(server) == "tenant-a"
    assert complete(server, "key-of-b")[0] == 200
    assert newest_namespace(server) == "tenant-b"
    # Tenant a names tenant b's namespace itself: the middleware's placement stands.
    status, _ = complete(server, "key-of-a", kv_transfer_params={"strata_namespace": "tenant-b"})
    assert status == 200 and newest_namespace(server) == "tenant-a"


@pytest.mark.parametrize(("key", "message"), [(None, "an API key is required"), ("guessed", "unknown API key")])
def test_a_request_without_a_tenant_s_key_is_refused_by_name(server, key, message):
    status, body = complete(server, key)
    assert status == 401 and body["error"]["message"].startswith(message)
