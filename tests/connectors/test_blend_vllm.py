"""Fragment reuse served by a real vLLM: the trained multi-hop fixture's passages, read once in
groups, are stored by Strata; then each question (the passages in a new order) is served from
them by vLLM with StrataConnector blending (the fragments loaded from the host tier, re-aligned,
r% recomputed over vLLM's own model, the rest of the prompt computed by vLLM). Fusing with
nothing recomputed loses answers; the default r answers as vLLM alone does."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.blend.conftest import MULTIHOP_MODEL
from tests.connectors.conftest import environment, host_only_transfer
from worker.dataplane.blend.options import BlendOptions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEFAULT = BlendOptions()
QUESTIONS = 100
PASSAGES = 8
SEED = 11
TOLERANCE = 1e-3
"""First-token logprob gap allowed against vLLM alone (asked in one batch) on this float32
checkpoint: the selective recompute's own full prefill is 1.6e-5 from vLLM's
(test_blend_model.py), a scrambled page's KV moves an answer by more than 0.1."""


def task() -> tuple[list[list[int]], list[Any]]:
    """The warm-up prompts (the corpus in groups of passages) and the questions."""
    from benchmarks.models.blend import BOS, QUERY, task_questions

    corpus, draw = task_questions("multihop", passages=PASSAGES, seed=SEED)
    warm = []
    for first in range(0, len(corpus), PASSAGES):
        prompt = [BOS]
        for passage in corpus[first : first + PASSAGES]:
            prompt += passage.tokens
        warm.append([*prompt, QUERY])
    rng = random.Random(SEED)
    return warm, [draw(rng) for _ in range(QUESTIONS)]


def engine(transfer: Any = None) -> Any:
    from vllm import LLM

    with environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}):
        return LLM(
            model=str(MULTIHOP_MODEL),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=1024,
            block_size=32,
            num_gpu_blocks_override=64,
            kv_transfer_config=transfer,
            seed=0,
        )


def blending(pool: str, percent: float) -> Any:
    return engine(
        host_only_transfer(
            f"blend-r{percent:g}",
            pool,
            host_bytes="64MiB",
            block_tokens=32,
            blend=True,
            blend_recompute_percent=percent,
        )
    )


def answers(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
        use_tqdm=False,
    )


def served(llm: Any, warm: list[list[int]], questions: list[Any]) -> list[Any]:
    """The warm-up read (and stored), then every question asked one at a time."""
    answers(llm, warm)
    time.sleep(2.0)  # the save queue's thread stores the warm-up's blocks outside the step
    assert llm.reset_prefix_cache()
    return [answers(llm, [q.prompt])[0] for q in questions]


def scrambling_then(outcome: str) -> Any:
    """A blended load that writes noise into every page it was to fill, then raises (`raise`: a
    recompute that fails part-way, reported) or returns as if whole (`unreported`: the guard off)."""
    import torch

    from worker.dataplane.connectors.vllm import blend_load

    def run(self: Any, spec: Any, paged: Any) -> Any:
        n = paged.page_tokens
        generator = torch.Generator().manual_seed(spec.end)
        for k, v in zip(paged.k, paged.v, strict=True):
            for page in spec.pages[spec.start // n : -(-spec.end // n)]:
                k[page].copy_(torch.randn(k[page].shape, generator=generator))
                v[page].copy_(torch.randn(v[page].shape, generator=generator))
        if outcome == "raise":
            raise RuntimeError("the selective recompute failed part-way (injected)")
        return blend_load.Blended(0.0, {}, 0, 0)

    return run


def failing(pool: str, outcome: str, warm: list[list[int]], questions: list[Any]) -> list[Any]:
    from worker.dataplane.connectors.vllm import blend_load

    real = blend_load.BlendLoads.run
    blend_load.BlendLoads.run = scrambling_then(outcome)  # this process runs vLLM's worker
    try:
        llm = blending(pool, DEFAULT.recompute_percent)
        try:
            return served(llm, warm, questions)
        finally:
            llm.llm_engine.engine_core.shutdown()
    finally:
        blend_load.BlendLoads.run = real


def gap(want: Any, have: Any) -> float:
    """The largest difference of the first token's top logprobs (inf: a different token)."""
    mine, theirs = have.outputs[0], want.outputs[0]
    if mine.token_ids[0] != theirs.token_ids[0]:
        return float("inf")
    return max(
        abs(theirs.logprobs[0][t].logprob - lp.logprob) for t, lp in mine.logprobs[0].items() if t in theirs.logprobs[0]
    )


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    import os
    import uuid

    warm, questions = task()
    results: dict[str, Any] = {"questions": questions}
    plain = engine()
    try:
        results["vllm"] = answers(plain, [q.prompt for q in questions])
    finally:
        plain.llm_engine.engine_core.shutdown()
    for name in ("r0", f"r{DEFAULT.recompute_percent:g}", "raise", "unreported"):
        pool = f"strata-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            if name in ("raise", "unreported"):
                results[name] = failing(pool, name, warm, questions[:20])
            else:
                llm = blending(pool, float(name[1:]))
                try:
                    results[name] = served(llm, warm, questions)
                finally:
                    llm.llm_engine.engine_core.shutdown()
        finally:
            for leftover in Path("/dev/shm").glob(f"{pool}*"):
                leftover.unlink(missing_ok=True)
    yield results


def accuracy(outputs: list[Any], questions: list[Any]) -> float:
    return sum(o.outputs[0].token_ids[0] == q.answer for o, q in zip(outputs, questions, strict=True)) / len(questions)


def test_the_questions_are_served_from_fragments(runs) -> None:
    questions = runs["questions"]
    for name in ("r0", f"r{DEFAULT.recompute_percent:g}"):
        cached = [o.num_cached_tokens or 0 for o in runs[name]]
        # BOS and the eight passages' 256 tokens: every passage a fragment (vLLM alone caches none of it).
        assert sum(cached) / len(cached) >= 0.9 * 8 * 32, (name, cached[:10])
    assert len(questions) == QUESTIONS


def test_fused_fragments_lose_answers_and_the_default_r_answers_as_vllm_does(runs) -> None:
    questions = runs["questions"]
    full = accuracy(runs["vllm"], questions)
    fused = accuracy(runs["r0"], questions)
    default = accuracy(runs[f"r{DEFAULT.recompute_percent:g}"], questions)
    report = {"vllm": full, "r0": fused, f"r{DEFAULT.recompute_percent:g}": default}
    assert full >= 0.95, report
    assert full - fused >= 0.20, report
    assert full - default <= 0.02, report
    print(report)


def test_a_blended_load_that_fails_is_recomputed_whole_and_answers_as_vllm_alone(runs) -> None:
    """Its pages hold noise when it fails: vLLM recomputes them, so every answer is vLLM's own."""
    gaps = [gap(want, have) for want, have in zip(runs["vllm"], runs["raise"], strict=False)]
    assert max(gaps) < TOLERANCE, f"largest gap {max(gaps)}: {gaps}"


def test_the_comparison_fails_with_the_failure_left_unreported(runs) -> None:
    """The guard turned off (the noisy pages served as if assembled): answers leave vLLM's."""
    gaps = [gap(want, have) for want, have in zip(runs["vllm"], runs["unreported"], strict=False)]
    assert max(gaps) > 100 * TOLERANCE, gaps
