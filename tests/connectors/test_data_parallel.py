"""vLLM's OpenAI server at data parallel 2 with Strata: each rank's scheduler serves its own status
endpoints (the status port plus its rank: no clash), both ranks share the node's tiers, so what one
rank stored is a hit on the other, and every answer equals vLLM alone's at data parallel 2 token by
token, its logprobs within a tolerance measured from vLLM alone's two ranks against each other.

The rank is chosen per request with vLLM's `X-data-parallel-rank` header. vLLM's CPU backend runs
two ranks here with one core each (VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.differential import TOLERANCE_FLOOR
from tests.connectors.vllm_servers import openai_server, strata_transfer
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 128
PROMPTS = [random.Random(seed).choices(range(3, 250), k=4 * BLOCK + 40) for seed in range(3)]
"""Three prompts of four full blocks and a tail."""
TOP = 5


@contextlib.contextmanager
def server(checkpoint: Path, *, pool: str = "", status: int = 0) -> Iterator[str]:
    """vLLM's OpenAI server at data parallel 2; with Strata's connector (host tier `pool`, status
    endpoints from `status`) when a pool is named."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env |= {"STRATA_BLOCK_TOKENS": str(BLOCK), "STRATA_STATUS_PORT": str(status)}
    args = ["--block-size", "32", "--num-gpu-blocks-override", "64", "--data-parallel-size", "2"]
    args += ["--enable-prompt-tokens-details", "--seed", "0"]
    if pool:
        extra = {"node_name": "data-parallel", "tiers": "host", "host_pool_name": pool, "host_bytes": "64MiB"}
        args += ["--kv-transfer-config", strata_transfer(extra)]
    with openai_server(checkpoint, args, env=env, pools=[pool] if pool else [], label="vllm-dp") as served:
        yield served["base"]


def complete(base: str, checkpoint: Path, prompt: list[int], rank: int) -> dict[str, Any]:
    """A greedy answer of four tokens with the top logprobs at each, from data-parallel rank `rank`."""
    payload = {
        "model": str(checkpoint),
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": TOP,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        body = json.loads(answer.read())
    choice = body["choices"][0]
    details = body["usage"].get("prompt_tokens_details") or {}
    return {
        "tokens": choice["logprobs"]["tokens"],
        "top": choice["logprobs"]["top_logprobs"],
        "cached": int(details.get("cached_tokens") or 0),
    }


def deviation(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest logprob difference of a token both answers rank in their top at a position
    (infinite where their tokens differ)."""
    if a["tokens"] != b["tokens"]:
        return float("inf")
    worst = 0.0
    for mine, theirs in zip(a["top"], b["top"], strict=True):
        for token in set(mine) & set(theirs):
            worst = max(worst, abs(mine[token] - theirs[token]))
    return worst


def two_free_ports() -> int:
    """A port that nothing listens on, nor on the next one (the second rank's status port)."""
    for _ in range(100):
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two consecutive free ports")


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_two_data_parallel_ranks_share_the_tiers_and_answer_as_vllm_alone(tmp_path, record_property):
    from worker.dataplane.models.loading import save_preset

    checkpoint = save_preset("small", tmp_path / "small")
    with server(checkpoint) as alone:
        reference = [complete(alone, checkpoint, prompt, rank=0) for prompt in PROMPTS]
        other = [complete(alone, checkpoint, prompt, rank=1) for prompt in PROMPTS]
    noise = max(deviation(a, b) for a, b in zip(reference, other, strict=True))
    assert noise != float("inf"), "vLLM alone's two ranks answer differently"
    tolerance = max(TOLERANCE_FLOOR, 2 * noise)

    status = two_free_ports()
    pool = f"strata-test-dp-{os.getpid()}"
    with server(checkpoint, pool=pool, status=status) as base:
        stored = [complete(base, checkpoint, prompt, rank=0) for prompt in PROMPTS]
        time.sleep(1)  # the first rank's blocks are stored beside its steps
        served = [complete(base, checkpoint, prompt, rank=1) for prompt in PROMPTS]
        ranks = [f"http://127.0.0.1:{status + rank}" for rank in (0, 1)]
        hit_tokens = [metric(url, "strata_hit_tokens_total") for url in ranks]
    worst = max(deviation(a, b) for a, b in zip(reference + reference, stored + served, strict=True))
    cached = [answer["cached"] for answer in served]
    for name, value in {"noise": noise, "deviation": worst, "cached_tokens": sum(cached)}.items():
        record_property(name, value)
    assert worst <= tolerance, f"vLLM with Strata at data parallel 2 deviates by {worst} (tolerance {tolerance})"
    assert all(n >= 4 * BLOCK for n in cached), f"the second rank was to serve the first rank's blocks: {cached}"
    assert hit_tokens[0] == 0 and hit_tokens[1] >= 3 * 4 * BLOCK, f"hit tokens by rank: {hit_tokens}"
