"""The workloads' sessions in token ids, sized by one `Shape`, and the summary of a run of them:
what the `vllm` suites and the GPU side-by-side script send (through benchmarks.workloads.vllm_api
and worker.workload.drive).

    multiturn     conversations of a private context and turns of a user message and the answer,
                  the next turn asked when the answer is in, conversations taken round-robin by the
                  clients: between two turns of one conversation the others fill the KV space.
    longdoc       documents asked once, then asked again after the others pushed them out of
                  vLLM's KV space; the second asks are measured.
    nohit         unique prompts, nothing to reuse: what the connector costs.
    rag           retrieval-augmented prompts: a system header every prompt shares, then passages
                  drawn from a corpus in a new order each time, then a question. The corpus is read
                  once in groups first (as earlier requests would have brought it); the prompts
                  after it are measured, each asked alone. Prefix caching finds the header only.

Every prompt is unique to its workload, so one server runs them all in turn.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence

from worker.workload import Outcome, Step

TokenStep = Step[list[int]]
"""A step of a token-id session: the next prompt from the conversation so far, and its answer length."""


SMALL_MODEL_BELOW = 0.05
"""Runs at a smaller scale (the smoke) serve the `small` preset instead of `bench`."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one run (scale 1: the issue's)."""

    pages: int = 96
    """vLLM's KV space in 128-token pages (12288 tokens): what HBM is on a GPU node, a few
    running requests' worth, far less than the sessions' state."""
    floor_pages: int = 512
    """The floor configuration's KV space (65536 tokens): every workload's sessions at once."""
    max_model_len: int = 11264
    """The long documents' prompts fit; vLLM wants a little more KV space than one request of it."""
    conversations: int = 10
    turns: int = 6
    context_tokens: int = 1536
    user_tokens: int = 160
    answer_tokens: int = 32
    documents: int = 3
    document_tokens: int = 10240
    question_tokens: int = 32
    doc_answer_tokens: int = 16
    nohit_requests: int = 48
    nohit_tokens: int = 1024
    nohit_answer_tokens: int = 16
    rag_header_tokens: int = 256
    rag_passages: int = 16
    rag_passage_tokens: int = 256
    rag_corpus: int = 48
    rag_prompts: int = 8
    rag_untimed: int = 2
    rag_question_tokens: int = 16
    rag_answer_tokens: int = 8
    rag_accuracy_questions: int = 100
    """Questions of the trained fixture's RAG task (benchmarks.workloads.vllm_api.rag_accuracy)."""
    preset: str = "bench"
    """The model preset served (saved as a checkpoint under var/checkpoints)."""
    dtype: str = "bfloat16"

    @classmethod
    def at(cls, scale: float) -> Shape:
        if scale >= 1:
            return cls()
        # The smoke (scale 0.01) checks that every configuration yields its rows, not how fast:
        # the `small` preset in float32 computes quickly on any CPU (bf16 is slow without
        # AVX-512 BF16), so the smoke's time is the servers' starts.
        small = scale < SMALL_MODEL_BELOW
        return cls(
            preset="small" if small else "bench",
            dtype="float32" if small else "bfloat16",
            conversations=max(4, int(10 * scale)),
            turns=max(2, int(6 * scale)),
            context_tokens=max(256, int(1536 * scale)),
            documents=2,
            document_tokens=max(1024, int(10240 * scale)),
            nohit_requests=max(4, int(48 * scale)),
            nohit_tokens=max(256, int(1024 * scale)),
            rag_passages=4,
            rag_corpus=8,
            rag_prompts=3,
            rag_accuracy_questions=10,
        )


def tokens(count: int, seed: int) -> list[int]:
    """A prompt piece of byte-tokenizer ids (printable bytes), reproducible from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(35, 130) for _ in range(count)]


def multiturn_sessions(shape: Shape, seed: int) -> list[list[TokenStep]]:
    def session(index: int) -> list[TokenStep]:
        context = [1, *tokens(shape.context_tokens, seed=seed * 1000 + index)]

        def turn(number: int) -> TokenStep:
            def make(history: list[int] | None) -> tuple[list[int], int]:
                user = tokens(shape.user_tokens, seed=seed * 1000 + 100 * index + number + 1)
                return (history or context) + user, shape.answer_tokens

            return make

        return [turn(t) for t in range(shape.turns)]

    return [session(i) for i in range(shape.conversations)]


def longdoc_sessions(shape: Shape, seed: int, ask: int) -> list[list[TokenStep]]:
    """One single-step session per document: its `ask`-th question about it."""

    def ask_doc(doc: int) -> list[TokenStep]:
        document = [1, *tokens(shape.document_tokens, seed=seed * 1000 + doc)]
        question = tokens(shape.question_tokens, seed=seed * 1000 + 100 + 10 * doc + ask)
        return [lambda _history: (document + question, shape.doc_answer_tokens)]

    return [ask_doc(d) for d in range(shape.documents)]


def nohit_sessions(shape: Shape, seed: int) -> list[list[TokenStep]]:
    def one(index: int) -> list[TokenStep]:
        prompt = [1, *tokens(shape.nohit_tokens, seed=seed * 1000 + index)]
        return [lambda _history: (prompt, shape.nohit_answer_tokens)]

    return [one(i) for i in range(shape.nohit_requests)]


def rag_sessions(shape: Shape, seed: int) -> tuple[list[list[TokenStep]], list[list[TokenStep]]]:
    """The warm-up (the corpus read in groups of `rag_passages` after the shared header, then
    `rag_untimed` prompts as the measured ones are) and the measured prompts (the header,
    `rag_passages` passages drawn in a new order, a question), each a single-step session. The
    untimed prompts let every configuration meet the measured shapes once first (a fresh server
    builds its kernels for the shapes it meets: vLLM's own for a full prefill, the selective
    recompute's for a blended one)."""
    header = [1, *tokens(shape.rag_header_tokens - 1, seed=seed * 1000)]
    corpus = [tokens(shape.rag_passage_tokens, seed=seed * 1000 + 1 + i) for i in range(shape.rag_corpus)]
    rng = random.Random(seed)

    def one(passages: Sequence[list[int]], question: int) -> list[TokenStep]:
        prompt = [*header, *(t for passage in passages for t in passage)]
        prompt += tokens(shape.rag_question_tokens, seed=seed * 1000 + 500 + question)
        return [lambda _history: (prompt, shape.rag_answer_tokens)]

    k = shape.rag_passages
    warm = [one(corpus[first : first + k], first) for first in range(0, len(corpus), k)]
    drawn = [one(rng.sample(corpus, k), len(corpus) + i) for i in range(shape.rag_untimed + shape.rag_prompts)]
    return warm + drawn[: shape.rag_untimed], drawn[shape.rag_untimed :]


def summary(outcomes: Sequence[Outcome], wall: float) -> dict[str, float]:
    ttft = [o.ttft_s for o in outcomes]
    later = [o.ttft_s for o in outcomes if o.step > 0]
    tpot = [(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in outcomes if o.output_tokens > 1]
    return {
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_later_mean_s": statistics.mean(later) if later else 0.0,
        "tpot_ms": 1000 * statistics.mean(tpot) if tpot else 0.0,
        "throughput_tok_s": sum(o.output_tokens for o in outcomes) / wall,
        "requests_per_s": len(outcomes) / wall,
        "cached_share": sum(o.cached_tokens for o in outcomes) / max(1, sum(o.prompt_tokens for o in outcomes)),
        "cached_tokens_mean": statistics.mean(o.cached_tokens for o in outcomes),
        "wall_s": wall,
        "requests": float(len(outcomes)),
    }
