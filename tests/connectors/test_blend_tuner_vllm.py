"""The quality guard of fragment reuse on a real vLLM: every blended question of the multi-hop fixture
is also computed in vLLM's worker, off the requests' path, by a full prefill; at r = 0 and at the
raised r of 5% (checked at layer 1, where this model's bindings do not deviate yet, both lose
answers: its quality.json) agreement stays low, so the namespace's r is raised, then it falls back
to prefix reuse, and its questions are served without fragments. The operator resets it through
the node's /v1/strata/blend, and the counters reach /metrics."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import host_only_transfer
from tests.connectors.test_blend_vllm import answers, engine, task
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "tuner-admin-key"
LOW, CEILING = 0.0, 5.0
BLENDED = 4 * 32
"""Cached prompt tokens past which a question was served from fragments (an exact prefix alone,
vLLM's or Strata's, is BOS and at most one passage of 32 tokens)."""


def call(port: int, method: str = "GET", body: dict[str, Any] | None = None, key: str = ADMIN) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/strata/blend",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, int]]:
    port = free_port()
    pool = f"strata-test-tuner-{uuid.uuid4().hex[:8]}"
    llm = engine(
        host_only_transfer(
            "blend-tuner",
            pool,
            host_bytes="64MiB",
            block_tokens=32,
            blend=True,
            blend_recompute_percent=LOW,
            blend_check_layer=1,
            blend_sample_rate=1.0,
            blend_min_samples=6,
            blend_raise_step_percent=CEILING - LOW,
            blend_max_percent=CEILING,
            blend_reprobe_seconds=0,
            status_port=port,
            node_admin_key=ADMIN,
        )
    )
    try:
        yield llm, port
    finally:
        llm.llm_engine.engine_core.shutdown()
        for leftover in Path("/dev/shm").glob(f"{pool}*"):
            leftover.unlink(missing_ok=True)


def test_low_agreement_raises_r_then_falls_back_to_prefix_reuse(served) -> None:
    import time

    llm, port = served
    warm, questions = task()
    answers(llm, warm)
    time.sleep(2.0)  # the save queue's thread stores the warm-up's blocks outside the step
    assert llm.reset_prefix_cache()
    seen = []
    for q in questions[:60]:
        percent = call(port)[1]["namespaces"].get("default", {}).get("recompute_percent", LOW)
        (out,) = answers(llm, [q.prompt])
        seen.append(((out.num_cached_tokens or 0) >= BLENDED, percent))
        state = call(port)[1]["namespaces"].get("default", {})
        if state.get("mode") == "prefix-only":
            break
    status, report = call(port)
    assert status == 200 and report["enabled"] is True
    state = report["namespaces"]["default"]
    assert state["mode"] == "prefix-only", (state, seen)
    assert state["raised"] == 1 and state["recompute_percent"] == CEILING
    assert (True, LOW) in seen and (True, CEILING) in seen, seen  # blended at r = 0, then at the raised r
    assert report["quality_samples"]["disagreed"] >= 1
    assert report["adjustments"]["raised"] == 1 and report["adjustments"]["fallback"] == 1
    # Past the fallback the namespace reuses prefixes only: vLLM computes the passages.
    rest = questions[len(seen) : len(seen) + 3]
    assert all((o.num_cached_tokens or 0) < BLENDED for o in answers(llm, [q.prompt for q in rest]))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as page:
        metrics = page.read().decode()
    assert 'strata_blend_prefix_only{model="blend-multihop",namespace="default",node="blend-tuner"} 1.0' in metrics
    assert 'strata_blend_adjustments_total{action="fallback",node="blend-tuner"} 1.0' in metrics

    # The operator resets the namespace: it blends again at its configured r.
    status, state = call(port, "POST", {"namespace": "default", "reset": True})
    assert status == 200 and state["mode"] == "blend" and state["recompute_percent"] == LOW
    rng = random.Random(3)
    again = questions[len(seen) + 3 + rng.randrange(3)]
    (out,) = answers(llm, [again.prompt])
    assert (out.num_cached_tokens or 0) >= BLENDED


def test_operator_changes_are_checked_by_name_and_need_the_admin_key(served) -> None:
    _, port = served
    assert call(port, key="wrong")[0] == 401
    status, body = call(port, "POST", {"namespace": "default", "percent": 140})
    assert status == 400 and body["error"]["param"] == "percent" and "140" in body["error"]["message"]
    status, body = call(port, "POST", {"namespace": "default", "ratio": 5})
    assert status == 400 and body["error"]["param"] == "ratio"
    status, body = call(port, "POST", {"namespace": "default", "percent": 20, "reset": True})
    assert status == 400 and "not both" in body["error"]["message"]
    status, state = call(port, "POST", {"namespace": "default", "percent": 20})
    assert status == 200 and state["recompute_percent"] == 20 and state["mode"] == "blend"
    assert call(port)[1]["namespaces"]["default"]["recompute_percent"] == 20
