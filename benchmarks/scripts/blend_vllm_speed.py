"""RAG prompts through vLLM: vLLM alone, vLLM with Strata reusing prefixes only, and vLLM with
Strata blending fragments, side by side on the same prompts, one engine at a time in this process.

    python -m benchmarks.scripts.blend_vllm_speed [--runs N] [--prompts N]

The corpus's passages are read once in groups (each group after a header of its own), so Strata
stores them; then each RAG prompt is a header never seen before and `--passages` passages drawn
in a new order: vLLM's prefix cache and Strata's prefix reuse find only what follows the same
header (nothing), fragment reuse finds every passage. TTFT is the time to the first token of a
prompt asked alone (`max_tokens=1`); reused tokens are vLLM's `num_cached_tokens`. The
configurations run in turn, `--runs` times; the table gives each one's median and spread, and
the ratios of the medians.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIGS = ("vllm", "strata_prefix", "strata_blend")


def engine(checkpoint: Path, config: str, *, pool: str, block_tokens: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if config != "vllm":
        transfer = KVTransferConfig(
            kv_connector="StrataConnectorBase",
            kv_connector_module_path="worker.dataplane.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "node_name": f"bench-{config}",
                "tiers": "host",
                "host_pool_name": pool,
                "host_bytes": "2GiB",
                "block_tokens": block_tokens,
                "blend": config == "strata_blend",
            },
        )
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        max_model_len=8192,
        block_size=128,
        num_gpu_blocks_override=96,
        kv_transfer_config=transfer,
        seed=0,
    )


def ask(llm: Any, prompt: Sequence[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt))], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
    )
    return time.perf_counter() - started, out.num_cached_tokens or 0


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(7)

    def text(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    corpus = [text(args.passage_tokens) for _ in range(args.corpus)]
    warm = []
    for first in range(0, len(corpus), args.passages):
        warm.append([token for passage in corpus[first : first + args.passages] for token in passage])
        warm[-1] = [*text(args.header_tokens), *warm[-1], *text(16)]
    prompts = []
    for _ in range(args.prompts):
        chosen = rng.sample(corpus, args.passages)
        prompts.append([*text(args.header_tokens), *[t for p in chosen for t in p], *text(16)])
    return warm, prompts


def run_config(
    checkpoint: Path, config: str, warm: list[list[int]], prompts: list[list[int]], block_tokens: int
) -> tuple[float, float]:
    pool = f"strata-blend-speed-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    llm = engine(checkpoint, config, pool=pool, block_tokens=block_tokens)
    try:
        ask(llm, warm[0][: len(warm[0]) // 2])  # kernels compiled for these sizes, untimed
        for prompt in warm:
            ask(llm, prompt)
        time.sleep(3.0)  # the save queue's thread stores the warm-up's blocks outside the step
        llm.reset_prefix_cache()
        asked = [ask(llm, prompt) for prompt in prompts]
    finally:
        llm.llm_engine.engine_core.shutdown()
        for leftover in Path("/dev/shm").glob(f"{pool}*"):
            leftover.unlink(missing_ok=True)
    return statistics.mean(t for t, _ in asked), statistics.mean(c for _, c in asked)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--passages", type=int, default=16)
    parser.add_argument("--passage-tokens", type=int, default=256)
    parser.add_argument("--header-tokens", type=int, default=256)
    parser.add_argument("--corpus", type=int, default=48)
    parser.add_argument("--preset", default="bench")
    args = parser.parse_args(argv)

    from controlplane.runtime.environment import load_environment
    from worker.dataplane.models.loading import preset_checkpoint

    checkpoint = preset_checkpoint(args.preset, load_environment().var_dir / "checkpoints")
    import json

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    warm, prompts = workload(args, vocab)
    ttft: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cached: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for run in range(args.runs):
        for config in CONFIGS:
            mean_ttft, mean_cached = run_config(checkpoint, config, warm, prompts, args.passage_tokens)
            ttft[config].append(mean_ttft)
            cached[config].append(mean_cached)
            print(
                f"run {run + 1}/{args.runs} {config}: TTFT {mean_ttft:.3f} s, {mean_cached:.0f} tokens reused",
                flush=True,
            )
    median = {c: statistics.median(v) for c, v in ttft.items()}
    print(
        f"\n{len(prompts[0])}-token prompts: a {args.header_tokens}-token header never seen, "
        f"{args.passages} passages of {args.passage_tokens}"
    )
    for config in CONFIGS:
        spread = f"{min(ttft[config]):.3f}-{max(ttft[config]):.3f}"
        reused = statistics.median(cached[config])
        print(f"{config:14s} TTFT median {median[config]:.3f} s (runs {spread}), reused tokens {reused:.0f}")
    print(f"blend / vllm alone      {median['strata_blend'] / median['vllm']:.3f}")
    print(f"blend / prefix-only     {median['strata_blend'] / median['strata_prefix']:.3f}")
    prefix_reused = statistics.median(cached["strata_prefix"])
    print(f"reused: blend {statistics.median(cached['strata_blend']):.0f} vs prefix-only {prefix_reused:.0f} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
