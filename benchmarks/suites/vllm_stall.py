"""Suite `vllm_stall`: a slow tier delays only the request that waits for it. vLLM with Strata
writing back to the disk tier, whose reads the kernel holds to RATE (benchmarks.runtime.throttle: a
network volume, a busy SSD), serves four clients decoding long answers while a long document,
stored on that disk and gone from vLLM's KV space, is asked again: its load takes seconds.

Two servers, the same workload: `async` (the default: a disk hit loads outside the engine step
while the others decode) and `sync` (STRATA_ASYNC_LOAD_TIERS empty: the load runs inside the
step, layer by layer, and every request of the step waits for it). For each, the time between
two tokens of the four clients (their TPOT) while the document loads (from its request to its
first token), against the same clients' with no load in flight.

Sizes at scale 1: the `vllm` suite's long document (10240 tokens, 40 blocks, 80 MiB in bf16),
RATE 20 MB/s (a 4 s load); four clients of 256-token prompts and 160-token answers.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from benchmarks.harness import Context, Row
from benchmarks.runtime.servers import Server, vllm_cpu_server
from benchmarks.runtime.throttle import throttled_reads
from benchmarks.suites.vllm import scratch_control_plane
from benchmarks.workloads.sessions import Shape, tokens
from benchmarks.workloads.vllm_api import complete, drive

DESCRIPTION = "vLLM + Strata: decoding clients' TPOT while a long document loads from a throttled disk"

RATE = 20_000_000
"""Bytes per second the disk tier's reads are held to."""
MODES = {"async": "disk,remote", "sync": ""}
"""Each server's STRATA_ASYNC_LOAD_TIERS."""
CLIENTS = 4
ANSWER_TOKENS = 160

EXPECTED_ROWS = [
    f"vllm_stall.{mode}.{name}"
    for mode in MODES
    for name in ("tpot_idle_ms", "tpot_during_load_ms", "tpot_during_load_vs_idle", "document_ttft_s")
]


def stream(client: Any, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """When each token of a streamed completion arrived (perf_counter)."""
    arrivals: list[float] = []
    complete(client, model, prompt, max_tokens, arrivals=arrivals)
    return arrivals


def gaps(arrivals: list[list[float]], start: float = 0.0, end: float = float("inf")) -> list[float]:
    """Times between two tokens of one answer, the later one inside [start, end)."""
    return [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if start <= b < end]


def decoders(server: Server, seed: int, *, document: list[int] | None, delay_s: float) -> dict[str, Any]:
    """Four clients decoding; with `document`, it is asked `delay_s` after they start."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=900, max_retries=0)
    arrivals: list[list[float]] = [[] for _ in range(CLIENTS)]
    sent_document: list[float] = []
    document_tokens: list[float] = []
    errors: list[BaseException] = []

    def decode(i: int) -> None:
        try:
            arrivals[i] = stream(client, server.model, [1, *tokens(256, seed=seed * 100 + i)], ANSWER_TOKENS)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    def ask() -> None:
        try:
            time.sleep(delay_s)
            sent_document.append(time.perf_counter())
            document_tokens.extend(stream(client, server.model, document or [], 4))
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(CLIENTS)]
    if document is not None:
        threads.append(threading.Thread(target=ask))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"arrivals": arrivals, "sent": sent_document[0] if sent_document else 0.0, "document": document_tokens}


def run_mode(server: Server, shape: Shape, progress: Any) -> dict[str, float]:
    document = [1, *tokens(shape.document_tokens, seed=700)]
    progress(f"vllm_stall: {server.label}: warming up, then the document stored and pushed out of vLLM's pages")
    drive(server.base, server.model, [[lambda _h: ([1, *tokens(300, seed=701)], 8)]], clients=1)
    drive(server.base, server.model, [[lambda _h: (document + tokens(32, seed=702), 4)]], clients=1)
    others = [[lambda _h, i=i: ([1, *tokens(shape.document_tokens, seed=710 + i)], 4)] for i in range(2)]
    drive(server.base, server.model, others, clients=1)
    time.sleep(2.0)  # the write-back of the document's blocks has landed on the disk
    progress(f"vllm_stall: {server.label}: {CLIENTS} clients decoding, alone and while the document loads")
    idle = decoders(server, seed=720, document=None, delay_s=0.0)
    loaded = decoders(server, seed=730, document=document + tokens(32, seed=703), delay_s=1.0)
    first_token = loaded["document"][0]
    during = gaps(loaded["arrivals"], loaded["sent"], first_token)
    idle_gaps = gaps(idle["arrivals"])
    tpot_idle = statistics.mean(idle_gaps)
    # No token at all while the document loads (every client stalled with it): the window itself.
    tpot_during = statistics.mean(during) if during else first_token - loaded["sent"]
    return {
        "tpot_idle_ms": 1000 * tpot_idle,
        "tpot_during_load_ms": 1000 * tpot_during,
        "tpot_during_load_vs_idle": tpot_during / tpot_idle,
        "document_ttft_s": first_token - loaded["sent"],
        "tokens_during_load": float(len(during)),
        "worst_gap_during_load_ms": 1000 * max(during, default=first_token - loaded["sent"]),
    }


def run(ctx: Context) -> list[Row]:
    shape = Shape.at(ctx.scale)
    ctx.params.update(rate_bytes_per_s=RATE, document_tokens=shape.document_tokens, clients=CLIENTS)
    ctx.plan(len(MODES) + 1)
    results: dict[str, dict[str, float]] = {}
    with scratch_control_plane(ctx) as (env, checkpoint, logs):
        ctx.step("scratch database migrated")
        for mode, tiers in MODES.items():
            # The servers start inside the throttle: their processes' reads of the disk are held to RATE.
            with throttled_reads(ctx.scratch, RATE) as throttle:
                ctx.params["throttle"] = throttle
                with vllm_cpu_server(
                    "strata_disk",
                    label=f"stall_{mode}",
                    checkpoint=checkpoint,
                    shape=shape,
                    scratch=ctx.scratch / mode,
                    env={**env, "STRATA_ASYNC_LOAD_TIERS": tiers},
                    logs=logs,
                ) as served:
                    results[mode] = run_mode(served, shape, ctx.log)
            ctx.step(f"{mode} done")
    rows = []
    for mode, numbers in results.items():
        note = {
            "tpot_during_load_vs_idle": "target <= 1.1 (async)" if mode == "async" else "the load inside the step",
            "document_ttft_s": "the document's load from the throttled disk",
        }
        rows += [
            Row(f"vllm_stall.{mode}.tpot_idle_ms", numbers["tpot_idle_ms"], "ms"),
            Row(
                f"vllm_stall.{mode}.tpot_during_load_ms",
                numbers["tpot_during_load_ms"],
                "ms",
                note=f"{numbers['tokens_during_load']:.0f} tokens, "
                f"worst gap {numbers['worst_gap_during_load_ms']:.0f} ms",
            ),
            Row(
                f"vllm_stall.{mode}.tpot_during_load_vs_idle",
                numbers["tpot_during_load_vs_idle"],
                "x",
                baseline=f"vllm_stall.{mode}.tpot_idle_ms",
                note=note["tpot_during_load_vs_idle"],
            ),
            Row(f"vllm_stall.{mode}.document_ttft_s", numbers["document_ttft_s"], "s", note=note["document_ttft_s"]),
        ]
    return rows
