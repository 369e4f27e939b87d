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
    args = ["--num-gpu-blocks-override", "32", "--middleware", NAMESPACE_MIDDLEWARE, "--enable-scale-out"]
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


def post(server: dict[str, Any], path: str, key: str | None, body: dict[str, Any]) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server["base"] + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def newest(server: dict[str, Any]) -> dict[str, Any]:
    """The connector's newest request timeline (`/v1/strata/requests`)."""
    request = urllib.request.Request(
        server["status"] + "/v1/strata/requests?limit=1", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.loads(answer.read())["requests"][0])


PROMPT = list(range(3, 3 + 200))
CHAT = [{"role": "user", "content": "which tier holds the block?"}]
PLACED_BODIES: dict[str, Any] = {
    "/v1/completions": lambda model: {"model": model, "prompt": PROMPT, "max_tokens": 1},
    "/v1/chat/completions": lambda model: {"model": model, "messages": CHAT, "max_tokens": 1},
    "/v1/chat/completions/batch": lambda model: {"model": model, "messages": [CHAT], "max_tokens": 1},
    "/v1/responses": lambda model: {"model": model, "input": "which tier holds the block?", "max_output_tokens": 1},
    "/v1/messages": lambda model: {"model": model, "messages": CHAT, "max_tokens": 1},
    "/inference/v1/generate": lambda model: {
        "model": model,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 1},
    },
    "/invocations": lambda model: {"model": model, "prompt": PROMPT, "max_tokens": 1},
}
"""A request to each route of vLLM 0.32 that runs a generating model and hands kv_transfer_params
to the engine (`tenancy.ROUTES`)."""


@pytest.mark.parametrize("path", sorted(PLACED_BODIES))
def test_every_route_that_runs_the_model_places_the_request_by_its_tenant_s_key(server, path):
    body = PLACED_BODIES[path](server["model"])
    status, answer = post(server, path, None, body)
    assert status == 401, answer
    status, answer = post(server, path, "key-of-b", body)
    assert status == 200, answer
    assert newest(server)["namespace"] == "tenant-b"
    status, answer = post(server, path, "key-of-a", body)
    assert status == 200, answer
    assert newest(server)["namespace"] == "tenant-a"


def test_a_route_that_cannot_carry_the_namespace_runs_without_the_cache_never_in_the_default_one(server):
    """/generative_scoring runs the model without kv_transfer_params: the tenant's key is checked,
    and the engine serves it without the cache (counted `uncached.unplaced`)."""
    body = {"model": server["model"], "query": PROMPT, "items": [[7, 8, 9]], "label_token_ids": [5, 6]}
    status, answer = post(server, "/generative_scoring", None, body)
    assert status == 401, answer
    status, answer = post(server, "/generative_scoring", "key-of-a", body)
    assert status == 200, answer
    trace = newest(server)
    assert (trace["namespace"], trace["uncached"]) == ("", "unplaced")


def test_the_structured_decisions_route_is_behind_the_tenant_s_key(server):
    """/v1/systemone runs the model (on models that support it; this one does not, and vLLM says
    so) without kv_transfer_params: behind the tenant's key, like every route that may run it."""
    body = {
        "model": server["model"],
        "state": "a block in the host tier",
        "questions": {"tier": {"type": "choice", "criteria": {"host": None, "disk": None}}},
    }
    status, answer = post(server, "/v1/systemone", None, body)
    assert status == 401, answer
    status, answer = post(server, "/v1/systemone", "key-of-a", body)
    assert status == 501 and "structured decision" in answer["error"]["message"], answer


def test_a_route_the_middleware_does_not_know_is_refused(server):
    status, answer = post(server, "/v1/not-a-vllm-route", "key-of-a", {"model": server["model"]})
    assert status == 404
    assert "a route Strata's namespace mapping does not know" in answer["error"]["message"]
