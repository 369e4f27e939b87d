"""Suite `blend`: fragment reuse (content matching + RoPE re-alignment + selective recompute) against
prefix-only caching and full prefill, on a RAG and a contract workload.

Quality, reuse and TTFT are measured on the trained model of tests/fixtures/blend-model (8 layers,
hidden 128; `python -m benchmarks.models.blend train` makes it): a RAG request is a 64-token system
header, k = 16 passages of 128 tokens drawn from a corpus of 48 in random order, then a question
whose answer is in one passage (2,114 tokens); 32-token blocks. The contract workload draws 6
clauses (passages) from a library of 24 in random order, with unique party text (8-24 tokens)
between them and no segments marked, so only the rolling scan finds them. Every request runs
three ways, interleaved: blend (r = 15% unless STRATA_BENCH_BLEND_PERCENT), prefix-only caching,
and full prefill (no cache).

TTFT is also measured with random weights (speed only) on larger shapes: the `small` preset
(hidden 256, 4 layers) and `small-deep` (the same with 16 layers: the check layer that every token
still goes through is 1/16 of the model, as in real 28-80-layer models rather than 1/4) on RAG
prompts of 16 passages x 256 tokens after a 256-token header (4.4K tokens, 256-token blocks). Rows:

- blend.rag.reused_tokens_vs_prefix_only: prompt tokens served from the cache, blend / prefix-only;
- blend.rag.ttft_vs_full_prefill: full-prefill TTFT / blend TTFT (how many times faster), warm half;
- blend.rag.accuracy_delta_pts: full-prefill accuracy - blend accuracy, in points;
- the same for the contract workload, and blend.long_<preset>.ttft_vs_full_prefill on the presets;
- blend.multihop.accuracy_delta_pts and blend.multihop.r0_accuracy_delta_pts: accuracy lost at the
  default r and with nothing recomputed (r = 0, no check layer) on the multi-hop task of
  tests/fixtures/blend-multihop (8 passages of 32 tokens whose bindings take their value from another
  passage; `python -m benchmarks.models.multihop`).
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Context, Row
from benchmarks.models import blend as task

DESCRIPTION = "Fragment reuse: reused tokens vs prefix-only, TTFT vs full prefill, accuracy delta (trained model)"
EXPECTED_ROWS = ("blend.rag.*", "blend.contract.*", "blend.multihop.*", "blend.long_small.*", "blend.long_small_deep.*")
"""The RAG and contract workloads, the multi-hop task's quality, long prompts on both presets."""
MODEL_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "blend-model"


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    return task.kl_divergence(reference, other)


def _stream(
    engines: dict[str, Any],
    requests: Sequence[tuple[list[int], int, list[tuple[int, int]] | None]],
    progress: Callable[[str], None],
    label: str,
) -> dict[str, list[dict[str, float]]]:
    """Run every request on blend, prefix-only and full prefill in turn (interleaved: drift hits all
    alike); the engines' block pools are released at the end."""
    try:
        return _interleaved(engines, requests, progress, label)
    finally:
        for engine in engines.values():
            engine.close()
            engine.store.close()


def _interleaved(
    engines: dict[str, Any],
    requests: Sequence[tuple[list[int], int, list[tuple[int, int]] | None]],
    progress: Callable[[str], None],
    label: str,
) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {"blend": [], "prefix_only": [], "full": []}
    for i, (prompt, answer, segments) in enumerate(requests):
        full = engines["prefix_only"].generate(prompt, max_tokens=1, use_cache=False)
        blended = engines["blend"].generate(prompt, max_tokens=1, segments=segments)
        prefix = engines["prefix_only"].generate(prompt, max_tokens=1)
        for name, result in (("blend", blended), ("prefix_only", prefix), ("full", full)):
            trace = result.trace
            runs[name].append(
                {
                    "ttft": trace.ttft_s,
                    "right": float(result.output_ids[0] == answer),
                    "reused": float(trace.prefix_tokens + trace.fragment_tokens),
                    "prefix": float(trace.prefix_tokens),
                    "fragment": float(trace.fragment_tokens),
                    "recomputed": float(trace.recomputed_tokens),
                    "kl": _kl(full.first_logits, result.first_logits),
                    "prompt": float(len(prompt)),
                }
            )
        if (i + 1) % 25 == 0:
            progress(f"blend: {label} {i + 1}/{len(requests)} requests")
    return runs


def _rows(prefix: str, runs: dict[str, list[dict[str, float]]], note: str) -> list[Row]:
    warm = len(runs["full"]) // 2  # the second half: every chunk has been seen at least once, mostly

    def total(name: str, field: str) -> float:
        return sum(r[field] for r in runs[name])

    def ttft(name: str) -> float:
        return statistics.median(r["ttft"] for r in runs[name][warm:])

    def accuracy(name: str) -> float:
        return 100 * total(name, "right") / len(runs[name])

    prompt_tokens = total("full", "prompt")
    blend_reused, prefix_reused = total("blend", "reused"), total("prefix_only", "reused")
    rows = [
        Row(
            f"{prefix}.prefix_only.reused_tokens",
            prefix_reused,
            "tokens",
            note=f"{100 * prefix_reused / prompt_tokens:.1f}% of {prompt_tokens:.0f} prompt tokens",
        ),
        Row(
            f"{prefix}.blend.reused_tokens",
            blend_reused,
            "tokens",
            note=f"{100 * blend_reused / prompt_tokens:.1f}%: prefix {total('blend', 'prefix'):.0f} + fragment "
            f"{total('blend', 'fragment'):.0f}; {total('blend', 'recomputed'):.0f} recomputed",
        ),
        Row(
            f"{prefix}.reused_tokens_vs_prefix_only",
            blend_reused / max(prefix_reused, 1.0),
            "x",
            baseline=f"{prefix}.prefix_only.reused_tokens",
            note=note,
        ),
        Row(f"{prefix}.full.ttft_s", ttft("full"), "s", note="median of the warm half"),
        Row(f"{prefix}.prefix_only.ttft_s", ttft("prefix_only"), "s"),
        Row(f"{prefix}.blend.ttft_s", ttft("blend"), "s"),
        Row(
            f"{prefix}.ttft_vs_full_prefill",
            ttft("full") / ttft("blend"),
            "x",
            baseline=f"{prefix}.blend.ttft_s",
            note="how many times faster than a full prefill",
        ),
    ]
    if any(r["right"] for r in runs["full"]):
        rows += [
            Row(f"{prefix}.full.accuracy_pct", accuracy("full"), "%"),
            Row(f"{prefix}.prefix_only.accuracy_pct", accuracy("prefix_only"), "%"),
            Row(
                f"{prefix}.blend.accuracy_pct",
                accuracy("blend"),
                "%",
                note=f"mean KL vs full {statistics.mean(r['kl'] for r in runs['blend']):.4f}",
            ),
            Row(
                f"{prefix}.accuracy_delta_pts",
                accuracy("full") - accuracy("blend"),
                "pts",
                note="full prefill accuracy minus blend accuracy",
            ),
        ]
    return rows


def _engines(model: Any, *, percent: float, block_tokens: int, blocks: int) -> dict[str, Any]:
    return {
        "blend": task.fixture_engine(model, block_tokens=block_tokens, blocks=blocks, percent=percent),
        "prefix_only": task.fixture_engine(model, block_tokens=block_tokens, blocks=blocks, enabled=False),
    }


RAG_PASSAGES = 16
"""Passages per RAG request: 16 chunks of 128 tokens, a 2K-token prompt (RAG contexts are 2-8K)."""


def rag_workload(model: Any, *, requests: int, percent: float, progress: Callable[[str], None]) -> list[Row]:
    rng = random.Random(1)
    corpus = task.make_corpus(48, seed=2)
    header = task.words(rng, 63)  # with BOS, two whole blocks: prefix-only reuses all of it
    stream: list[tuple[list[int], int, list[tuple[int, int]] | None]] = []
    for _ in range(requests):
        q = task.make_question(rng, rng.sample(corpus, RAG_PASSAGES), header=header)
        stream.append((q.prompt, q.answer, q.segments))
    runs = _stream(_engines(model, percent=percent, block_tokens=32, blocks=4096), stream, progress, "RAG")
    return _rows(
        "blend.rag",
        runs,
        f"{requests} requests, {RAG_PASSAGES} of 48 passages of "
        f"{task.PASSAGE_TOKENS} tokens each after a 64-token header, r={percent:g}%",
    )


def contract_workload(model: Any, *, requests: int, percent: float, progress: Callable[[str], None]) -> list[Row]:
    rng = random.Random(3)
    clauses = task.make_corpus(24, seed=4)
    preamble = task.words(rng, 31)
    stream: list[tuple[list[int], int, list[tuple[int, int]] | None]] = []
    for _ in range(requests):
        chosen = rng.sample(clauses, 6)
        prompt = [task.BOS, *preamble]
        for clause in chosen:
            # Party names, dates, amounts: text unique to this contract between the shared clauses.
            prompt += task.words(rng, rng.randint(8, 24))
            prompt += clause.tokens
        key, value = rng.choice(task.unique_pairs(chosen))
        stream.append(([*prompt, task.QUERY, key], value, None))
    runs = _stream(_engines(model, percent=percent, block_tokens=32, blocks=4096), stream, progress, "contracts")
    return _rows(
        "blend.contract",
        runs,
        f"{requests} contracts of 6 of 24 clauses at varying offsets, no segments, r={percent:g}%",
    )


def long_prompt_ttft(
    *, preset: str, requests: int, passages: int, passage_tokens: int, percent: float, progress: Callable[[str], None]
) -> list[Row]:
    """TTFT where prefill dominates: a random-weight preset on long RAG prompts (speed only)."""
    from worker.dataplane.models.loading import load_model  # noqa: PLC0415

    model = load_model(preset, device="cpu")
    rng = random.Random(5)
    corpus = [[rng.randrange(3, 259) for _ in range(passage_tokens)] for _ in range(2 * passages)]
    header = [1, *(rng.randrange(3, 259) for _ in range(255))]
    stream: list[tuple[list[int], int, list[tuple[int, int]] | None]] = []
    for _ in range(requests):
        prompt, segments = list(header), []
        for passage in rng.sample(corpus, passages):
            segments.append((len(prompt), len(prompt) + len(passage)))
            prompt += passage
        stream.append((prompt + [rng.randrange(3, 259) for _ in range(16)], -1, segments))
    engines = _engines(model, percent=percent, block_tokens=256, blocks=512)
    # Warm the cache with every passage once (as earlier requests would have), then measure.
    for first in range(0, len(corpus), passages):
        prompt, segments = list(header), []
        for passage in corpus[first : first + passages]:
            segments.append((len(prompt), len(prompt) + len(passage)))
            prompt += passage
        engines["blend"].generate(prompt + [5], max_tokens=1, segments=segments)
        engines["prefix_only"].generate(prompt + [5], max_tokens=1)
    runs = _stream(engines, stream, progress, f"long prompts on {preset}")
    # Every passage is warm already: all requests count (listed twice so the "warm half" is all of them).
    rows = _rows(
        f"blend.long_{preset.replace('-', '_')}",
        {name: [*r, *r] for name, r in runs.items()},
        f"{preset} preset ({model.layers} layers), {len(stream[0][0])}-token prompts, r={percent:g}%",
    )
    return [row for row in rows if "ttft" in row.name or "reused_tokens_vs" in row.name]


MULTIHOP_DIR = task.FIXTURE_DIRS["multihop"]


def multihop_quality(*, questions: int, percent: float) -> list[Row]:
    """Accuracy lost on the multi-hop task (tests/fixtures/blend-multihop), whose bindings take
    their value from another passage: fused KV with nothing recomputed lacks it (the `fused`
    variant: r = 0 and no check layer), blend at the default r recomputes it."""
    from benchmarks.models import multihop as multihop_task  # noqa: PLC0415

    report = task.quality_report(
        MULTIHOP_DIR,
        task="multihop",
        questions=questions,
        passages=multihop_task.MAX_PASSAGES,
        percents=[percent],
        selections=("deviation",),
    )
    full = 100 * report["full"]["accuracy"]
    at_r = report[f"blend_r{percent:g}"]
    at_0 = report["fused"]
    note = f"{questions} questions, {multihop_task.MAX_PASSAGES} passages of {multihop_task.PASSAGE_TOKENS} tokens"
    return [
        Row("blend.multihop.full.accuracy_pct", full, "%", note=note),
        Row(
            "blend.multihop.accuracy_delta_pts",
            full - 100 * at_r["accuracy"],
            "pts",
            note=f"full prefill minus blend at r={percent:g}% (mean KL {at_r['kl']:.4f})",
        ),
        Row(
            "blend.multihop.r0_accuracy_delta_pts",
            full - 100 * at_0["accuracy"],
            "pts",
            note=f"full prefill minus fused KV at r=0, no layer recomputed (mean KL {at_0['kl']:.4f}): what "
            "recompute has to win back",
        ),
    ]


def run(ctx: Context) -> list[Row]:
    if not (MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"{MODEL_DIR} holds no model; make it with `python -m benchmarks.models.blend train --out {MODEL_DIR}`"
        )
    from worker.dataplane.models.loading import load_model  # noqa: PLC0415

    percent = float(os.environ.get("STRATA_BENCH_BLEND_PERCENT", "15"))
    scale = min(ctx.scale, 1.0)
    requests = max(20, int(200 * scale))
    long_requests = max(3, int(12 * scale))
    ctx.params.update(
        model=str(MODEL_DIR.relative_to(MODEL_DIR.parents[2])),
        recompute_percent=percent,
        requests=requests,
        long_models=["small", "small-deep"],
        long_requests=long_requests,
    )
    ctx.plan(5)
    model = load_model(str(MODEL_DIR), device="cpu")
    rows = rag_workload(model, requests=requests, percent=percent, progress=ctx.log)
    ctx.step("RAG done")
    if (MULTIHOP_DIR / "config.json").exists():
        rows += multihop_quality(questions=max(50, int(200 * scale)), percent=percent)
        ctx.step("multi-hop quality done")
    else:
        ctx.step(
            f"multi-hop quality skipped: {MULTIHOP_DIR} holds no model (python -m benchmarks.models.multihop train)"
        )
    rows += contract_workload(model, requests=requests, percent=percent, progress=ctx.log)
    ctx.step("contracts done")
    for preset in ("small", "small-deep"):
        rows += long_prompt_ttft(
            preset=preset, requests=long_requests, passages=16, passage_tokens=256, percent=percent, progress=ctx.log
        )
        ctx.step(f"long prompts on {preset} done")
    return rows
