"""Namespaces inside a real vLLM OpenAI server: NamespaceMiddleware places each request by its tenant's
API key, the connector in vLLM's engine honours the namespace it vouched for and no client claim,
and a request without a tenant's key is refused by name."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.connectors.vllm_servers import openai_server, strata_transfer
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "admin-key-of-the-tenancy-test"
KEYS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    from worker.dataplane.models.loading import save_preset
    from worker.vllm_server import NAMESPACE_MIDDLEWARE

    checkpoint = save_preset("small", tmp_path_factory.mktemp("checkpoint") / "small")
    status = free_port()
    pool = f"strata-test-tenancy-{os.getpid()}"
    extra = {"node_name": "tenancy", "tiers": "host", "host_pool_name": pool, "host_bytes": "32MiB"}
    env = {
        "STRATA_API_KEYS": ",".join(f"{key}={namespace}" for key, namespace in KEYS.items()),
        "STRATA_NAMESPACE_SECRET": secrets.token_urlsafe(32),
        "STRATA_NODE_ADMIN_KEY": ADMIN,
        "STRATA_STATUS_PORT": str(status),
        "STRATA_BLOCK_TOKENS": "128",
    }
    args = ["--num-gpu-blocks-override", "32", "--middleware", NAMESPACE_MIDDLEWARE]
    args += ["--kv-transfer-config", strata_transfer(extra)]
    with openai_server(checkpoint, args, env=env, pools=[pool], label="vllm-tenancy", start_timeout=300) as served:
        yield {**served, "status": f"http://127.0.0.1:{status}"}


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
