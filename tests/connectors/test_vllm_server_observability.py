"""vLLM's own observability of Strata, on a real vLLM OpenAI server with StrataConnector: the
connector's hits, loads and saves on vLLM's /metrics as `vllm:strata_*`, equal to what its status
endpoint counts, and the blocks it stores and evicts in vLLM's KV events (medium "strata-host"),
named by the same page hashes vLLM's own events give the GPU's pages, read with a ZMQ subscriber
and vLLM's own decoder.

One server for the module: a host tier of 8 blocks (so that the tests' prompts evict), vLLM's
pages of 32 tokens under Strata's blocks of 128, and vLLM's event publisher on.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.connectors.vllm_servers import openai_server, strata_transfer
from tests.support import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK, PAGE = 128, 32
HOST_BLOCKS = 8
ADMIN = "admin-key-of-the-observability-test"
TOPIC = "kv-events"


def prompt(seed: int) -> list[int]:
    """Four full blocks and a tail."""
    return random.Random(seed).choices(range(3, 250), k=4 * BLOCK + 40)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    from worker.dataplane.models.loading import save_preset

    checkpoint = save_preset("small", tmp_path_factory.mktemp("checkpoint") / "small")
    status, events = free_port(), free_port()
    pool = f"strata-test-observability-{os.getpid()}"
    block_bytes = 4 * 2 * BLOCK * 2 * 32 * 4  # the small preset: 4 layers, K and V, 2 kv heads of 32, float32
    extra = {
        "node_name": "observability",
        "tiers": "host",
        "host_pool_name": pool,
        "host_bytes": HOST_BLOCKS * block_bytes,
    }
    env = {
        "STRATA_BLOCK_TOKENS": str(BLOCK),
        "STRATA_STATUS_PORT": str(status),
        "STRATA_NODE_ADMIN_KEY": ADMIN,
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    publisher = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": TOPIC}
    args = ["--block-size", str(PAGE), "--num-gpu-blocks-override", "64", "--seed", "0"]
    args += ["--kv-transfer-config", strata_transfer(extra), "--kv-events-config", json.dumps(publisher)]
    with openai_server(checkpoint, args, env=env, pools=[pool], label="vllm-observability") as served:
        yield {**served, "status": f"http://127.0.0.1:{status}", "events": events}


def complete(server: dict[str, Any], tokens: list[int], max_tokens: int = 2) -> None:
    payload = {"model": server["model"], "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        server["base"] + "/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200


def tick(server: dict[str, Any]) -> None:
    """A short request (no full block): one more engine step, which brings the worker's report."""
    complete(server, [5, 6, 7], max_tokens=1)


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def value(found: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, have), v in found.items() if n == name and want <= have)


def written_blocks(server: dict[str, Any]) -> int:
    request = urllib.request.Request(
        server["status"] + "/v1/strata/requests?limit=500", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return sum(int(r["written_blocks"]) for r in json.loads(answer.read())["requests"])


def test_vllm_s_metrics_carry_strata_s_counts(server):
    tokens = prompt(1)
    complete(server, tokens)
    time.sleep(1)  # its blocks are stored beside the engine's steps
    reset = urllib.request.Request(server["base"] + "/reset_prefix_cache", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    complete(server, tokens)  # vLLM's own cache is empty: its four blocks come from Strata's host tier
    tick(server)

    same = [  # vLLM's name, the status endpoint's, their labels
        ("vllm:strata_hit_blocks_total", "strata_hit_blocks_total", {"tier": "host"}),
        ("vllm:strata_hit_tier_tokens_total", "strata_hit_tier_tokens_total", {"tier": "host"}),
        ("vllm:strata_hit_tokens_total", "strata_hit_tokens_total", {}),
        ("vllm:strata_lookup_tokens_total", "strata_lookup_tokens_total", {}),
        ("vllm:strata_load_failures_total", "strata_load_failures_total", {}),
    ]

    def agreeing() -> tuple[dict, dict] | None:
        vllm, strata = samples(server["base"]), samples(server["status"])
        pairs = [(value(vllm, mine, **labels), value(strata, theirs, **labels)) for mine, theirs, labels in same]
        pairs.append((value(vllm, "vllm:strata_saved_blocks_total", tier="host"), written_blocks(server)))
        return (vllm, strata) if all(a == b for a, b in pairs) else None

    vllm, strata = wait_for(agreeing, timeout=30, what="vLLM's /metrics to agree with the connector's status endpoint")
    assert value(vllm, "vllm:strata_hit_blocks_total", tier="host") >= 4
    assert value(vllm, "vllm:strata_hit_tokens_total") >= 4 * BLOCK - 1
    assert value(vllm, "vllm:strata_saved_blocks_total", tier="host") >= 4
    assert value(vllm, "vllm:strata_lookup_tokens_total") >= 2 * len(tokens)
    assert value(vllm, "vllm:strata_load_failures_total") == 0
    assert value(vllm, "vllm:strata_load_seconds_count") >= 1 and value(vllm, "vllm:strata_load_seconds_sum") > 0
    assert value(vllm, "vllm:strata_load_stall_seconds_count") >= 1
    engine = {"model_name": server["model"], "engine": "0"}
    assert value(vllm, "vllm:strata_hit_blocks_total", tier="host", **engine) >= 4  # labelled as vLLM's own


def test_vllm_s_kv_events_announce_strata_s_stores_and_evictions(server):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.connect(f"tcp://127.0.0.1:{server['events']}")
    socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    received: list[Any] = []

    def drain() -> None:
        while socket.poll(timeout=100):
            _, _, payload = socket.recv_multipart()
            received.extend(decoder.decode(payload).events)

    prompts = [prompt(seed) for seed in (11, 12, 13)]  # twelve blocks into a host tier of eight
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        for tokens in prompts:
            complete(server, tokens)
            time.sleep(0.5)
            drain()

        def strata(kind: type) -> list[Any]:
            return [e for e in received if isinstance(e, kind) and (e.medium or "").startswith("strata-")]

        def announced() -> bool:
            tick(server)
            drain()
            return len(strata(BlockStored)) >= 3 * 4 and len(strata(BlockRemoved)) >= 1

        wait_for(announced, timeout=60, what="Strata's stores and evictions in vLLM's KV events", every=0.5)
        tick(server)  # every store is reported by now; this step brings the last of them
        time.sleep(1)
        drain()
        evicted = value(samples(server["status"]), "strata_evictions_total", tier="host")
    finally:
        socket.close(linger=0)
        context.term()

    pages: dict[Any, list[int]] = {}  # vLLM's hash of a GPU page -> its tokens, from vLLM's own events
    for event in received:
        if isinstance(event, BlockStored) and event.medium == "GPU":
            for i, page in enumerate(event.block_hashes):
                pages[page] = event.token_ids[i * PAGE : (i + 1) * PAGE]
    stored = strata(BlockStored)
    by_tokens = {tuple(e.token_ids): e for e in stored}
    for tokens in prompts:
        for i in range(4):
            event = by_tokens.get(tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            assert event is not None, f"block {i} of a prompt was not announced stored"
            assert (event.medium, event.block_size, len(event.block_hashes)) == ("strata-host", PAGE, BLOCK // PAGE)
            # Named as vLLM names the GPU's pages of the same tokens.
            assert [pages.get(h) for h in event.block_hashes] == [
                event.token_ids[j * PAGE : (j + 1) * PAGE] for j in range(BLOCK // PAGE)
            ]
            assert (event.parent_block_hash is None) == (i == 0)
    removed = strata(BlockRemoved)
    assert all(e.medium == "strata-host" for e in removed)
    assert len(removed) == evicted, f"{len(removed)} removals announced, {evicted} evictions counted"
    assert any(e.block_hashes in [s.block_hashes for s in stored] for e in removed)
