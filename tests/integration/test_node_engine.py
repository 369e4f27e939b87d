"""A node serving a model end to end: `strata_node --model tiny` answers the OpenAI API, writes new
blocks to its host tier, registers them in PostgreSQL, reports real tier use in its heartbeat, and a
second request hits the cache."""

import openai
import pytest

from controlplane.directory.models import Block, Node, Placement
from tests.support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


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
