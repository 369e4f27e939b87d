"""Two node processes (`strata_node --model tiny`), each with its own host pool and disk, sharing
one L3 in Redis: a class that writes through puts turn 1 of a conversation served by node A in L3
beside A's own copy, the directory learns both placements, and node B serves turn 2 from L3 with
the greedy tokens of a run without any cache. The default class (on-demotion) writes nothing there."""

import json
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis

from controlplane.directory.models import Node, Placement
from controlplane.directory.services import namespace_ensure
from controlplane.policies.services import priorityclass_create
from tests.support import free_port, node_env, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]
BLOCK = 16

ADMIN_KEY = "fleet-nodes-admin-key"  # the nodes' request timelines need it


@pytest.fixture
def start_node(subprocess_env, python, tmp_path, settings) -> Iterator[Callable[[str, str], openai.OpenAI]]:
    """Start a node serving `tiny` with device, host, disk and the shared remote tier under `prefix`."""
    processes: list[tuple[subprocess.Popen, object, str]] = []
    remote_url = settings.ENV.redis.url

    def start(name: str, prefix: str) -> openai.OpenAI:
        port = free_port()
        log = open(tmp_path / f"{name}.log", "w+")
        env = {
            **node_env(subprocess_env, name),
            "STRATA_HOST_POOL_NAME": f"strata-test-{name}",
            "STRATA_BLOCK_TOKENS": str(BLOCK),
            "STRATA_HOST_BYTES": "64MiB",
            "STRATA_DEVICE_BYTES": "8MiB",
            "STRATA_TIERS": "device,host,disk,remote",
            "STRATA_REMOTE_URL": remote_url,
            "STRATA_REMOTE_PREFIX": prefix,
            "STRATA_REMOTE_BYTES": "64MiB",
            "STRATA_NODE_ADMIN_KEY": ADMIN_KEY,
            "STRATA_CLIENT_NAMESPACES": "true",  # tenants named by X-Strata-Namespace
        }
        command = [python, "manage.py", "strata_node", "--name", name, "--heartbeat-seconds", "0.5"]
        command += ["--model", "tiny", "--serve-port", str(port)]
        command += ["--disk-path", str(tmp_path / f"disk-{name}"), "--disk-bytes", "64MiB"]
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.append((process, log, name))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=120)
        wait_for(lambda: Node.objects.filter(name=name, heartbeats__gte=1).exists(), what=f"node {name}")
        wait_for(lambda: _answers(client), what=f"node {name}'s server")
        return client

    yield start
    for process, log, name in processes:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.seek(0)  # type: ignore[attr-defined]
        print(log.read()[-4000:])  # type: ignore[attr-defined]
        log.close()  # type: ignore[attr-defined]
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink()


@pytest.fixture
def l3_prefix(settings) -> Iterator[str]:
    prefix = f"strata-fleet-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(settings.ENV.redis.url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def _answers(client: openai.OpenAI) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.APIConnectionError:
        return False


def _last_trace(client: openai.OpenAI) -> dict:
    request = urllib.request.Request(
        f"{client.base_url}strata/requests?limit=1", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["requests"][0]


def test_turn_two_on_the_other_node_is_served_from_l3(start_node, l3_prefix):
    for namespace in ("chat", "plain"):
        namespace_ensure(name=namespace)
    # The built-in classes' device shares add up to 100%: this one takes none of the device tier.
    priorityclass_create(name="shared", device_share=0.0, namespaces=["chat"], remote_write="write-through")
    suffix = uuid.uuid4().hex[:6]
    a = start_node(f"fleet-a-{suffix}", l3_prefix)
    b = start_node(f"fleet-b-{suffix}", l3_prefix)

    def ask(client: openai.OpenAI, prompt: str, namespace: str, tokens: int):
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=tokens, extra_headers={"X-Strata-Namespace": namespace}
        )

    turn1 = "Strata keeps KV blocks in tiers, and the fleet shares the slowest one. " * 3
    first = ask(a, turn1, "chat", 16)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    written = (first.usage.prompt_tokens + 15) // BLOCK
    # The directory learns both copies: A's host tier and L3 (no node).
    wait_for(
        lambda: (
            Placement.objects.filter(tier="remote", state="ready", block__namespace__name="chat").count() == written
        ),
        what="the L3 placements of turn 1",
    )
    assert Placement.objects.filter(tier="host", node__name__startswith="fleet-a-", state="ready").count() == written
    turn2 = turn1 + first.choices[0].text + " And the next turn asks something else entirely."
    second = ask(b, turn2, "chat", 12)
    trace = _last_trace(b)
    # Every block of turn 1's prompt comes from L3 (the reply's last block may tokenize
    # differently once it is text in the next prompt).
    assert set(trace["hit_blocks_by_tier"]) == {"remote"}, trace
    hits = trace["hit_blocks_by_tier"]["remote"]
    assert first.usage.prompt_tokens // BLOCK <= hits <= written
    assert second.usage.prompt_tokens_details.cached_tokens == hits * BLOCK
    # The same conversation in a namespace of the default class (on-demotion): nothing cached
    # anywhere for it, so B computes it all — the reference tokens, and nothing goes to L3.
    cold = ask(b, turn2, "plain", 12)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].text == cold.choices[0].text
    b_blocks = wait_for(
        lambda: (
            Placement.objects.filter(tier="host", node__name__startswith="fleet-b-", block__namespace__name="plain")
            .filter(state="ready")
            .count()
        ),
        what="B's write-back of the plain turn",
    )
    assert b_blocks > 0
    assert not Placement.objects.filter(tier="remote", block__namespace__name="plain").exists()
