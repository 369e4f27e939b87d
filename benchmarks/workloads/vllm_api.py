"""Driving vLLM's OpenAI server with the token-id sessions of benchmarks.workloads.sessions: one
streamed completion (`complete`), the sessions with clients at once (`drive`, worker.workload's
driver), and every workload against one server of a `vllm` suite configuration (`run_config`).

Configurations, each a fresh server on the same checkpoint and KV space
(benchmarks.runtime.servers.vllm_cpu_server starts them):

    vllm          vLLM alone (its own prefix cache in its KV space)
    example       vLLM + ExampleConnector, vLLM's reference storage connector, on the same disk
    strata_host   vLLM + StrataConnector writing back to the host tier (a node: strata_node --engine vllm)
    strata_disk   vLLM + StrataConnector writing back to the disk tier
    floor         vLLM alone with a KV space that holds every session (nothing is evicted, no
                  request waits for room): a bound no KV offload reaches on the same workloads
    strata_blend  vLLM + StrataConnector (host) with fragment reuse on (STRATA_BLEND): the RAG workload only
    vllm_tp2, strata_host_tp2, floor_tp2
                  vLLM alone, vLLM + StrataConnector (host) and the floor at tensor parallel 2, one
                  core per rank (the other configurations compute on both cores in one rank)

The RAG workload (`rag`) runs on vllm, strata_host (prefix reuse only) and strata_blend; its
accuracy is measured on the trained fixture of tests/fixtures/blend-model served by a server of
the same configuration (`rag_accuracy`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from benchmarks.runtime.servers import Server
from benchmarks.workloads.sessions import (
    Shape,
    TokenStep,
    longdoc_sessions,
    multiturn_sessions,
    nohit_sessions,
    rag_sessions,
    summary,
    tokens,
)
from worker import workload
from worker.workload import Outcome

CONFIGS = (
    "vllm",
    "example",
    "strata_host",
    "strata_blend",
    "strata_disk",
    "floor",
    "vllm_tp2",
    "strata_host_tp2",
    "floor_tp2",
)
RAG_CONFIGS = ("vllm", "strata_host", "strata_blend")
"""The configurations that run the RAG workload: vLLM alone, prefix reuse only, fragment reuse."""


def complete(
    client: Any, model: str, prompt: list[int], max_tokens: int, *, arrivals: list[float] | None = None
) -> tuple[Outcome, list[int]]:
    """One streamed completion of token ids: its timings and the answer's ids; `arrivals` gets the
    time (perf_counter) each token arrived, for the gaps between them."""
    sent = time.perf_counter()
    first: float | None = None
    answer: list[int] = []
    usage: Any = None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            if ids or choice.text:
                now = time.perf_counter()
                first = first or now
                if arrivals is not None:
                    arrivals.extend([now] * max(1, len(ids)))
            answer.extend(ids)
    done = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    produced = int(usage.completion_tokens) if usage is not None else len(answer)
    return Outcome(
        ttft_s=(first or done) - sent,
        e2e_s=done - sent,
        output_tokens=produced,
        prompt_tokens=len(prompt),
        cached_tokens=cached,
    ), answer


def drive(base: str, model: str, sessions: Sequence[Sequence[TokenStep]], clients: int) -> tuple[list[Outcome], float]:
    """Run every session's steps in order against the server at `base`, each after the previous
    one's answer; `clients` requests in flight at once, the ready steps taken round-robin across
    sessions (worker.workload.drive). Returns the outcomes and the wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=900, max_retries=0)

    def send(prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
        outcome, answer = complete(client, model, prompt, max_tokens)
        return outcome, prompt + answer

    return workload.drive(sessions, send, clients=clients)


SKIPPED = {
    "example": {
        "longdoc": "ExampleConnector saves only a prompt's first prefill chunk (2048 tokens here) and "
        "kills vLLM's engine when it loads such a prompt back (vLLM 0.32: a shape mismatch "
        "in inject_kv_into_layer)"
    }
}
"""Workloads a configuration cannot serve, and why."""


WORKLOADS = ("multiturn.c4", "multiturn.c8", "longdoc", "nohit", "rag")
"""The workloads of a `vllm` suite configuration, in the order they run."""


def serves(config: str, workload: str) -> bool:
    """Whether `config` runs `workload`: the RAG workload runs on RAG_CONFIGS, strata_blend runs it
    alone (on the other workloads it is strata_host: prompts that share prefixes only)."""
    if workload == "rag":
        return config in RAG_CONFIGS
    return config != "strata_blend"


SAVES_SETTLE_S = 2.0
"""Time given to a Strata server's save queue (a thread outside the step) to store what the
warm-up computed before the measured prompts ask for it."""


def run_config(
    server: Server,
    shape: Shape,
    progress: Callable[[str], None],
    *,
    replay: bool = False,
    workloads: Collection[str] = WORKLOADS,
) -> dict[str, dict[str, float]]:
    """The `workloads` (default: every one) against one server; per workload, its summary. A fresh server compiles its
    kernels for the shapes it meets first: a few untimed requests of the workloads' sizes (prompts
    no workload shares) go first. With `replay`, only the 4-client multi-turn sessions, which a
    server of the same node served before (`Server(after=...)`)."""
    progress(f"vllm: {server.label}: warming up")
    warm = [
        [lambda _h, n=n, i=i: ([1, *tokens(n, seed=900 + i)], 8)]
        for i, n in enumerate((shape.context_tokens, shape.nohit_tokens, 300, shape.document_tokens // 2))
    ]
    drive(server.base, server.model, warm, clients=2)
    results: dict[str, dict[str, float]] = {}
    if replay:
        progress(f"vllm: {server.label}: multi-turn, 4 clients, the sessions its node stored before, again")
        results["multiturn.c4"] = summary(*drive(server.base, server.model, multiturn_sessions(shape, seed=14), 4))
        return results
    for clients in (4, 8):
        if f"multiturn.c{clients}" not in workloads:
            continue
        sessions = multiturn_sessions(shape, seed=10 + clients)
        progress(
            f"vllm: {server.label}: multi-turn, {clients} clients, {shape.conversations} conversations x "
            f"{shape.turns} turns"
        )
        results[f"multiturn.c{clients}"] = summary(*drive(server.base, server.model, sessions, clients))
    workloads = [w for w in workloads if serves(server.config, w)]
    skipped = SKIPPED.get(server.config, {})
    if "longdoc" not in workloads:
        pass
    elif "longdoc" in skipped:
        progress(f"vllm: {server.label}: long documents not run: {skipped['longdoc']}")
    else:
        progress(
            f"vllm: {server.label}: long documents ({shape.documents} x {shape.document_tokens} tokens), "
            "asked once, then again"
        )
        drive(server.base, server.model, longdoc_sessions(shape, seed=30, ask=0), clients=1)
        results["longdoc"] = summary(
            *drive(server.base, server.model, longdoc_sessions(shape, seed=30, ask=1), clients=1)
        )
    if "nohit" in workloads:
        progress(f"vllm: {server.label}: {shape.nohit_requests} prompts with nothing to reuse")
        results["nohit"] = summary(*drive(server.base, server.model, nohit_sessions(shape, seed=40), clients=4))
    if "rag" in workloads:
        warm, asked = rag_sessions(shape, seed=50)
        progress(
            f"vllm: {server.label}: RAG, the corpus of {shape.rag_corpus} passages read, then {len(asked)} prompts "
            f"of {shape.rag_passages} passages in a new order"
        )
        drive(server.base, server.model, warm, clients=1)
        time.sleep(SAVES_SETTLE_S)
        results["rag"] = summary(*drive(server.base, server.model, asked, clients=1))
    kept = server.keep_traces()
    if kept is not None:
        progress(f"vllm: {server.label}: the connector's request timelines are in {kept}")
    return results


@dataclasses.dataclass(frozen=True)
class FixtureShape:
    """The server size of the RAG accuracy fixture (32-token pages and blocks, float32)."""

    max_model_len: int = 4096
    pages: int = 256
    floor_pages: int = 256
    dtype: str = "float32"
    page_tokens: int = 32


def rag_accuracy(server: Server, questions: int, progress: Callable[[str], None]) -> dict[str, float]:
    """The blend suite's RAG task on its trained fixture (tests/fixtures/blend-model), asked through
    `server` (serving that fixture): the corpus read in groups first, then each question, a 64-token
    header and 16 of the 48 passages in a new order, asked alone. Accuracy is the share of first
    tokens that are the answer; the reused tokens are the server's cached prompt tokens."""
    from openai import OpenAI

    from benchmarks.models import blend as task

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=900, max_retries=0)
    rng = random.Random(1)
    corpus = task.make_corpus(48, seed=2)
    header = task.words(rng, 63)
    passages = 16
    progress(f"vllm: {server.label}: RAG accuracy, {questions} questions of {passages} passages")
    for first in range(0, len(corpus), passages):
        group = [t for passage in corpus[first : first + passages] for t in passage.tokens]
        complete(client, server.model, [task.BOS, *header, *group, task.QUERY], 1)
    time.sleep(SAVES_SETTLE_S)
    right, reused = 0, 0
    for _ in range(questions):
        q = task.make_question(rng, rng.sample(corpus, passages), header=header)
        outcome, answer = complete(client, server.model, q.prompt, 1)
        right += int(answer[:1] == [q.answer])
        reused += outcome.cached_tokens
    return {"accuracy_pct": 100 * right / questions, "cached_tokens_mean": reused / questions}
