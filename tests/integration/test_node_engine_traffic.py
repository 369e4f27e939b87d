"""A real node process meters what it serves and its heartbeat carries it: the control plane's
NodeTraffic row and the fleet shape load-following derives from it."""

import openai
import pytest
from django.utils import timezone

from controlplane.directory.models import NodeTraffic
from controlplane.policies.following import fleet_shape, loadfollowing_get
from tests.support import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


def test_the_heartbeat_carries_the_served_traffic(serving_node):
    name, port = serving_node
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=120)
    wait_for(lambda: _answers(client), what="the node server")
    short, long = [], []
    for i in range(4):
        short.append(client.completions.create(model="tiny", prompt=f"chat turn {i}", max_tokens=2))
    for i in range(2):
        long.append(client.completions.create(model="tiny", prompt=f"document {i} " * 150, max_tokens=2))
    assert all(r.usage.prompt_tokens < 128 for r in short)
    assert all(r.usage.prompt_tokens >= 256 for r in long)
    # A heartbeat taken while the last request was still finishing counts it in flight; the ones after
    # all six answered carry an empty queue.
    row = wait_for(
        lambda: NodeTraffic.objects.filter(node__name=name, requests__gte=6, queue_depth=0).first(),
        what="traffic in a heartbeat after the last answer",
    )
    assert row.requests == 6 and row.window_seconds == 60
    assert row.prompt_tokens == sum(r.usage.prompt_tokens for r in short + long)
    assert row.prompt_buckets[0] == 4 and sum(row.prompt_buckets[2:]) == 2
    assert 0 < row.l1_pressure <= 1  # the tiny model's blocks sit in its 8 MiB device tier
    settings = loadfollowing_get()
    settings.long_prompt_tokens = 256
    shape = fleet_shape(settings, timezone.now())
    assert shape is not None and shape.nodes == 1
    assert shape.requests_per_min == pytest.approx(6) and shape.long_share == pytest.approx(2 / 6)


def _answers(client) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.APIConnectionError:
        return False
