"""A node serving a model end to end: `strata_node --model tiny` answers the OpenAI API, writes new
blocks to its host tier, registers them in PostgreSQL, reports real tier use in its heartbeat, and a
second request hits the cache."""

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from controlplane.directory.models import Block, Node, Placement
from tests.support import free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture
def serving_node(subprocess_env, python, tmp_path) -> Iterator[tuple[str, int]]:
    name = f"eng-{uuid.uuid4().hex[:6]}"
    port = free_port()
    log = open(tmp_path / "node.log", "w+")
    env = {
        **subprocess_env,
        "STRATA_HOST_POOL_NAME": f"strata-test-{name}",
        "STRATA_BLOCK_TOKENS": "16",
        "STRATA_HOST_BYTES": "64MiB",
        "STRATA_DEVICE_BYTES": "8MiB",
        "STRATA_TIERS": "device,host,disk",
    }
    process = subprocess.Popen(
        [
            python,
            "manage.py",
            "strata_node",
            "--name",
            name,
            "--heartbeat-seconds",
            "0.5",
            "--model",
            "tiny",
            "--serve-port",
            str(port),
            "--disk-path",
            str(tmp_path / "disk"),
            "--disk-bytes",
            "64MiB",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield name, port
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.seek(0)
        print(log.read()[-5000:])
        log.close()
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink()


def test_node_serves_registers_and_hits(serving_node):
    name, port = serving_node
    node = wait_for(lambda: Node.objects.filter(name=name, heartbeats__gte=1).first(), what="the node")
    assert node.address == f"127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=120)
    wait_for(lambda: _answers(client), what="the node server")
    prompt = "Strata keeps KV blocks in tiers. " * 6
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    blocks = wait_for(
        lambda: Placement.objects.filter(node__name=name, tier="host", state="ready").count() or None,
        what="registrations in the directory",
    )
    assert blocks == (first.usage.prompt_tokens + 3) // 16
    assert Block.objects.filter(namespace__name="default").count() == blocks
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens // 16) * 16
    assert second.choices[0].text == first.choices[0].text
    host = wait_for(
        lambda: Node.objects.get(name=name).tiers.filter(tier="host", used_bytes__gt=0).first(),
        what="host use in a heartbeat",
    )
    assert host.capacity_bytes == 64 * 1024**2
    with pytest.raises(openai.BadRequestError, match="namespace: no namespace named 'nobody'"):
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, extra_headers={"X-Strata-Namespace": "nobody"}
        )


def _answers(client) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.APIConnectionError:
        return False
