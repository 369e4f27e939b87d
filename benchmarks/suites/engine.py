"""Suite `engine`: TTFT of a long prompt with a hit from each tier vs cold prefill and the medium's
floor (layer-wise loading on and off, and a case built so that loading takes as long as computing:
`balanced_*` on the local disk, and `balanced_throttled_*` with the disk's reads held to 200 MB/s
by the kernel's block throttle, so that the load is the medium's time rather than CPU and memory
traffic competing with the compute, on `bench-deep`, the bench model with Llama-3-8B's 32 layers;
as root, where a cgroup block controller exists), then the seeds' serving workloads - multi-turn
chat and long-document QA - under four setups.

Sizes at scale 1: an 8192+32-token prompt (an 8K document and a short question) on the `bench`
model (hidden 1024, 8 layers, bf16; 10K does not fit the time a 2-core machine gives a
benchmark); the workloads on the `small` model (hidden 256, 4 layers, fp32) so that the no-cache
runs finish in minutes: multi-turn chat with 4 and with 8 clients, 60 requests each time, over a
2048-token shared system prompt (96-token user turns), long-document QA with 4 clients, 4
documents of 8192 tokens asked 3 questions each in shuffled order, 32-token answers.
"""

from __future__ import annotations

from benchmarks.engine_workloads import (
    THROTTLED_MODEL,
    long_doc_suite,
    multi_turn_suite,
    ttft_suite,
)
from benchmarks.harness import Context, Row
from controlplane.runtime.environment import load_environment

DESCRIPTION = "TTFT per tier vs cold and vs the floor; multi-turn chat and long-doc QA vs no cache"
EXPECTED_ROWS = (
    *(f"engine.ttft_hit_{tier}_vs_cold" for tier in ("device", "host", "disk", "remote")),
    "engine.balanced_layerwise_vs_upfront",
    *(
        f"{workload}.{config}.ttft_vs_no_cache"
        for workload in ("multiturn.c4", "multiturn.c8", "longdoc")
        for config in ("device_only", "strata_host", "strata_disk")
    ),
)
"""A hit from each tier against a cold prefill, layer-wise loading against load-then-compute, and
each cache configuration against no cache on each workload (the throttled case needs a kernel
throttle the machine may lack, and is not required)."""


def run(ctx: Context) -> list[Row]:
    redis_url = load_environment().redis.url_for_db(7)
    scale = min(ctx.scale, 1.0)
    prompt_tokens = max(1024, int(8192 * scale)) + 32
    ctx.params.update(
        prompt_tokens=prompt_tokens, ttft_model="bench", throttled_model=THROTTLED_MODEL, workload_model="small"
    )
    ctx.plan(4)
    measures = ttft_suite(redis_url=redis_url, prompt_tokens=prompt_tokens, progress=ctx.log)
    ctx.step("ttft done")
    for clients in (4, 8):
        measures += multi_turn_suite(
            redis_url=redis_url,
            clients=clients,
            requests=max(8, int(60 * scale)),
            system_tokens=max(256, int(2048 * scale)),
            user_tokens=96,
            progress=ctx.log,
        )
        ctx.step(f"multi-turn with {clients} clients done")
    measures += long_doc_suite(
        redis_url=redis_url,
        documents=4 if scale >= 0.5 else 2,
        doc_tokens=max(1024, int(8192 * scale)),
        progress=ctx.log,
    )
    ctx.step("long-doc done")
    return [Row(name=m.name, value=m.value, unit=m.unit, baseline=m.baseline, note=m.note) for m in measures]
