"""Suite `vllm`: vLLM with Strata against vLLM alone (and against ExampleConnector, vLLM's reference
storage connector), on the seeds' workloads, served by vLLM's OpenAI server on the CPU backend.

The checkpoint is the `bench` preset saved as one (hidden 1024, 8 layers, bf16, a byte-level
tokenizer; the smoke serves `small` in float32), under var/checkpoints. vLLM's KV space is 96
pages of 128 tokens (12288 tokens; requests up to 11264), so the workloads' sessions overflow it
as HBM overflows on a GPU node.
Each configuration is a fresh server (see benchmarks.workloads.vllm_api); the Strata ones run as nodes
of a scratch control-plane database (`strata_node --engine vllm`); the servers' logs are kept in
var/bench-logs/vllm/. Every workload runs once per configuration and the ratios divide the same
workload's numbers in the same run.

`floor` is vLLM alone with a KV space of 512 pages, which holds every session: no prompt is ever
recomputed for lack of room, nothing is loaded, and no request waits for room. An offload loads
into the same 96 pages as vLLM alone, so its requests still wait for room when the sessions
running at once do not fit there (8 clients of ~2.7K-token conversations: 22K tokens), and every
conversation's first turn is cold in every configuration: `...floor.ttft_vs_vllm` bounds what
any KV offload can reach on these workloads, and `...ttft_vs_floor` is how far Strata is from it.
`...ttft_later_turns_vs_vllm` compares the turns after the first, the requests a cache can serve.

ExampleConnector does not run the long documents (benchmarks.workloads.vllm_api.SKIPPED says why). A
configuration that fails is reported (params.failed) and the others' rows are kept.
`vllm_tp2` and `strata_host_tp2` serve at tensor parallel 2 (one core per rank), compared with
each other; then a one-rank server of strata_host_tp2's node serves its 4-client multi-turn
sessions again (`strata_host_from_tp2`): every hit is a block two ranks wrote. `floor_tp2` is
the floor at two ranks, the bound of `strata_host_tp2`'s ratios.

RAG (`rag`): vllm, strata_host (prefix reuse only) and strata_blend (fragment reuse,
STRATA_BLEND) serve prompts of a 256-token header every prompt shares, then 16 passages of 256
tokens drawn from a corpus of 48 in a new order each time, then a 16-token question; the corpus
is read once in groups first, then 2 prompts drawn as the measured ones are go untimed (every
server meets the measured shapes once first), then 8 prompts are measured, each asked alone. Rows: TTFT, reused
tokens, and the accuracy of a server of the same configuration on the blend suite's trained
fixture (tests/fixtures/blend-model: its RAG task, 100 questions of 16 of 48 passages after a
64-token header, 32-token pages and blocks); strata_blend against the other two. strata_blend
runs the RAG workload only.

STRATA_BENCH_VLLM_CONFIGS (default: all) runs some of vllm, strata_host, strata_blend, example,
strata_disk, floor, vllm_tp2, strata_host_tp2, floor_tp2; STRATA_BENCH_VLLM_WORKLOADS (default: all)
some of multiturn.c4, multiturn.c8, longdoc, nohit, rag (strata_host_from_tp2 runs with
multiturn.c4 only). The rows and ratios of what is left out are not reported.

Sizes at scale 1: multi-turn with 4 and with 8 clients, 10 conversations x 6 turns (60 requests),
each a 1536-token private context, 160-token user turns and 32-token answers; long documents: 3 of
10240 tokens asked once, then again after the others pushed them out (the second asks measured);
no reuse: 48 unique 1024-token prompts with 4 clients.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness import Context, Row
from benchmarks.runtime.database import scratch_database
from benchmarks.runtime.servers import Server, vllm_cpu_server
from benchmarks.workloads.sessions import Shape
from benchmarks.workloads.vllm_api import (
    CONFIGS,
    SKIPPED,
    WORKLOADS,
    FixtureShape,
    rag_accuracy,
    run_config,
    serves,
)

DESCRIPTION = (
    "vLLM + Strata (host, disk, fragment reuse) vs vLLM alone and vs ExampleConnector: multi-turn, long docs, "
    "no reuse, RAG"
)

TARGETS = {
    "ttft_vs_vllm": "target <= 0.3 (mean TTFT)",
    "tpot_vs_vllm": "target <= 0.7",
    "throughput_vs_vllm.strata_host": "target >= 2.08",
    "throughput_vs_vllm.strata_disk": "target >= 1.68",
    "throughput_vs_vllm.strata_host_tp2": "target >= 2.08",
    "ttft_vs_example": "target <= 0.5",
    "nohit": "target <= 1.05",
    "floor": "vLLM alone with every session in its KV space: a bound no KV offload reaches (see the docstring)",
    "rag.ttft_vs_vllm": "target <= 0.45 (>= 2.2x faster)",
    "rag.ttft_vs_strata_host": "target <= 0.6 (prefix reuse only)",
    "rag.reused_vs_strata_host": "target >= 5",
    "rag.accuracy_delta_pts": "target <= 2 (vLLM alone's accuracy minus blend's, trained fixture)",
}
ORDER = (
    "vllm",
    "strata_host",
    "strata_blend",
    "example",
    "strata_disk",
    "floor",
    "vllm_tp2",
    "strata_host_tp2",
    "floor_tp2",
)
"""The configurations in the order they run (alternating with and without Strata)."""
FROM_TP2 = "strata_host_from_tp2"
"""After strata_host_tp2: a one-rank server of the same node serves its 4-client multi-turn
sessions again, from the blocks the two ranks stored."""
PEERS = {"strata_host": "vllm", "strata_disk": "vllm", "strata_host_tp2": "vllm_tp2"}
"""Each Strata configuration and the vLLM alone it is compared with (the same tensor parallel)."""


def chosen_configs() -> list[str]:
    """The configurations this run serves (STRATA_BENCH_VLLM_CONFIGS, default all), in ORDER."""
    assert set(ORDER) == set(CONFIGS)
    chosen = [c.strip() for c in os.environ.get("STRATA_BENCH_VLLM_CONFIGS", ",".join(ORDER)).split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONFIGS))
    if unknown:
        raise ValueError(
            f"STRATA_BENCH_VLLM_CONFIGS: unknown configuration(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(ORDER)}"
        )
    return [c for c in ORDER if c in chosen]


def chosen_workloads() -> list[str]:
    """The workloads each configuration runs (STRATA_BENCH_VLLM_WORKLOADS, default all), in order."""
    chosen = [w.strip() for w in os.environ.get("STRATA_BENCH_VLLM_WORKLOADS", ",".join(WORKLOADS)).split(",")]
    chosen = [w for w in chosen if w]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown or not chosen:
        raise ValueError(
            f"STRATA_BENCH_VLLM_WORKLOADS: unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"expected some of {', '.join(WORKLOADS)}"
        )
    return [w for w in WORKLOADS if w in chosen]


def expected_rows(ctx: Context) -> list[str]:
    """Every chosen configuration's own numbers on each chosen workload it serves, and each ratio
    whose two configurations both ran it."""
    workloads = chosen_workloads()
    return [row for row in _expected_rows() if _workload_of(row) in workloads]


RAG_METRICS = ("ttft_mean_s", "reused_tokens", "accuracy_pct")
"""The RAG workload's own rows of each configuration that runs it."""


def _workload_of(row: str) -> str:
    """The workload of a row named `vllm.<workload>.<config>...` (a multi-turn one names its clients)."""
    parts = row.split(".")
    return ".".join(parts[1:3]) if parts[1] == "multiturn" else parts[1]


def _expected_rows() -> list[str]:
    chosen = chosen_configs()
    patterns = [
        f"vllm.multiturn.c{clients}.{config}.ttft_mean_s"
        for config in chosen
        for clients in (4, 8)
        if serves(config, "multiturn.c4")
    ]
    patterns += [
        f"vllm.longdoc.{config}.ttft_mean_s"
        for config in chosen
        if serves(config, "longdoc") and "longdoc" not in SKIPPED.get(config, {})
    ]
    patterns += [f"vllm.nohit.{config}.ttft_mean_s" for config in chosen if serves(config, "nohit")]
    rag = [config for config in chosen if serves(config, "rag")]
    patterns += [f"vllm.rag.{config}.{metric}" for config in rag for metric in RAG_METRICS]
    if "strata_blend" in rag:
        patterns += [
            f"vllm.rag.strata_blend.{ratio}_{peer}"
            for peer in ("vllm", "strata_host")
            if peer in rag
            for ratio in ("ttft_vs", "reused_vs", "accuracy_delta_pts_vs")
        ]
    if "vllm" in chosen:
        for config in ("strata_host", "strata_disk", "floor"):
            if config in chosen:
                patterns += [f"vllm.multiturn.c4.{config}.ttft_vs_vllm", f"vllm.longdoc.{config}.ttft_vs_vllm"]
        if "strata_host" in chosen:
            patterns.append("vllm.nohit.strata.ttft_vs_vllm")
        if "strata_host_tp2" in chosen:
            patterns.append(f"vllm.multiturn.c4.{FROM_TP2}.ttft_vs_vllm")
    if "strata_host_tp2" in chosen:
        patterns.append(f"vllm.multiturn.c4.{FROM_TP2}.cached_share")
    if {"vllm_tp2", "strata_host_tp2"} <= set(chosen):
        patterns += [
            "vllm.multiturn.c4.strata_host_tp2.ttft_vs_vllm_tp2",
            "vllm.multiturn.c8.strata_host_tp2.ttft_vs_vllm_tp2",
            "vllm.nohit.strata_tp2.ttft_vs_vllm_tp2",
        ]
    if {"vllm_tp2", "floor_tp2"} <= set(chosen):
        patterns.append("vllm.multiturn.c4.floor_tp2.ttft_vs_vllm_tp2")
    if {"strata_host_tp2", "floor_tp2"} <= set(chosen):
        patterns.append("vllm.multiturn.c4.strata_host_tp2.ttft_vs_floor_tp2")
    if {"example", "strata_host"} <= set(chosen):
        patterns.append("vllm.multiturn.c4.strata_host.ttft_vs_example")
    return patterns


@contextlib.contextmanager
def scratch_control_plane(ctx: Context) -> Iterator[tuple[dict[str, str], Path, Path]]:
    """A scratch control-plane database (migrated, the default namespace made) for the servers of a
    run: yields their environment, the checkpoint of the run's preset (`bench`; `small` for the
    smoke) and the servers' log directory."""
    import subprocess
    import sys

    from controlplane.runtime.environment import REPO_ROOT, load_environment
    from worker.dataplane.models.loading import preset_checkpoint

    environment = load_environment()
    checkpoint = preset_checkpoint(Shape.at(ctx.scale).preset, environment.var_dir / "checkpoints")
    logs = environment.var_dir / "bench-logs" / "vllm"
    with scratch_database(f"strata_bench_vllm_{os.getpid()}") as url:
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "REDIS_URL": environment.redis.url,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.dev",
            "STRATA_LOG_LEVEL": "WARNING",
            "STRATA_VAR_DIR": str(environment.var_dir),
        }
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO_ROOT, env=env, check=True
        )
        subprocess.run(
            [sys.executable, "manage.py", "strata_namespace", "default"],
            cwd=REPO_ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        yield env, checkpoint, logs


def run(ctx: Context) -> list[Row]:
    chosen = chosen_configs()
    workloads = chosen_workloads()
    shape = Shape.at(ctx.scale)
    ctx.params.update(
        pages=shape.pages,
        conversations=shape.conversations,
        turns=shape.turns,
        context_tokens=shape.context_tokens,
        documents=shape.documents,
        document_tokens=shape.document_tokens,
    )
    ctx.plan(len(chosen) + 1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with scratch_control_plane(ctx) as (env, checkpoint, logs):
        ctx.params.update(checkpoint=str(checkpoint))
        ctx.step("scratch database migrated")
        failures: dict[str, str] = {}
        for config in [c for c in ORDER if c in chosen]:
            # One configuration failing (its server dying) must not lose the others' numbers.
            try:
                with vllm_cpu_server(
                    config,
                    checkpoint=checkpoint,
                    shape=shape,
                    scratch=ctx.scratch,
                    env=env,
                    logs=logs,
                ) as served:
                    results[config] = run_config(served, shape, ctx.log, workloads=workloads)
                    if config == "strata_host_tp2" and "multiturn.c4" in workloads:
                        served.stop()
                        try:
                            results[FROM_TP2] = from_tp2(served, checkpoint, shape, ctx, env, logs)
                        except Exception as exc:  # noqa: BLE001 - reported as its own failure
                            failures[FROM_TP2] = f"{type(exc).__name__}: {exc}"
                            ctx.log(f"[red]vllm: {FROM_TP2} failed ({failures[FROM_TP2]})")
                if "rag" in results[config]:  # its accuracy, on a server of the same configuration
                    results[config]["rag"].update(accuracy(config, shape, ctx, env, logs))
            except Exception as exc:  # noqa: BLE001 - reported below and in the results' params
                failures[config] = f"{type(exc).__name__}: {exc}"
                ctx.log(f"[red]vllm: {config} failed ({failures[config]}); its log: {logs / (config + '.log')}")
            ctx.step(f"{config} done")
    ctx.params.update(failed=failures, skipped=SKIPPED)
    if not results:
        raise RuntimeError(f"every configuration failed: {failures}")
    return rows_of(results)


def accuracy(config: str, shape: Shape, ctx: Context, env: dict[str, str], logs: Path) -> dict[str, float]:
    """The RAG accuracy of `config`: its server on the blend suite's trained fixture."""
    from benchmarks.models.blend import FIXTURE_DIRS

    fixture = FixtureShape()
    with vllm_cpu_server(
        config,
        label=f"{config}_accuracy",
        checkpoint=FIXTURE_DIRS["lookup"],
        shape=fixture,
        scratch=ctx.scratch,
        env=env,
        logs=logs,
        page_tokens=fixture.page_tokens,
        tokenizer=False,
    ) as served:
        found = rag_accuracy(served, shape.rag_accuracy_questions, ctx.log)
    return {"accuracy_pct": found["accuracy_pct"], "accuracy_reused_tokens": found["cached_tokens_mean"]}


def from_tp2(
    before: Server, checkpoint: Path, shape: Shape, ctx: Context, env: dict[str, str], logs: Path
) -> dict[str, dict[str, float]]:
    """A one-rank server of `before`'s node (stopped: its pool and disk kept) serves the 4-client
    multi-turn sessions again, from the blocks the two ranks stored."""
    with vllm_cpu_server(
        "strata_host",
        label=FROM_TP2,
        after=before,
        checkpoint=checkpoint,
        shape=shape,
        scratch=ctx.scratch,
        env=env,
        logs=logs,
    ) as served:
        return run_config(served, shape, ctx.log, replay=True)


def rows_of(results: dict[str, dict[str, dict[str, float]]]) -> list[Row]:
    rows: list[Row] = []
    for config, workloads in results.items():
        for workload, numbers in workloads.items():
            prefix = f"vllm.{workload}.{config}"
            rows += [
                Row(f"{prefix}.ttft_mean_s", numbers["ttft_mean_s"], "s"),
                *(
                    [
                        Row(
                            f"{prefix}.ttft_later_mean_s",
                            numbers["ttft_later_mean_s"],
                            "s",
                            note="turns after the first",
                        )
                    ]
                    if workload.startswith("multiturn")
                    else []
                ),
                Row(f"{prefix}.tpot_ms", numbers["tpot_ms"], "ms"),
                Row(
                    f"{prefix}.throughput_tok_s",
                    numbers["throughput_tok_s"],
                    "tok/s",
                    note=f"{numbers['requests']:.0f} requests in {numbers['wall_s']:.1f} s, "
                    f"{numbers['cached_share']:.0%} of prompt tokens not computed",
                ),
            ]

    def ratio(workload: str, config: str, metric: str, versus: str, name: str, target: str) -> None:
        if workload not in results.get(config, {}) or workload not in results.get(versus, {}):
            return  # left out of this run (STRATA_BENCH_VLLM_CONFIGS), failed, or not served (SKIPPED)
        numerator = results[config][workload][metric]
        baseline = results[versus][workload][metric]
        rows.append(
            Row(
                name,
                numerator / baseline if baseline else 0.0,
                "x",
                baseline=f"vllm.{workload}.{versus}.{metric}",
                note=target,
            )
        )

    rows += rag_rows(results)
    for config, peer in PEERS.items():
        for clients in (4, 8):
            workload = f"multiturn.c{clients}"
            ratio(
                workload,
                config,
                "ttft_mean_s",
                peer,
                f"vllm.{workload}.{config}.ttft_vs_{peer}",
                TARGETS["ttft_vs_vllm"],
            )
            ratio(
                workload, config, "tpot_ms", peer, f"vllm.{workload}.{config}.tpot_vs_{peer}", TARGETS["tpot_vs_vllm"]
            )
            ratio(
                workload,
                config,
                "ttft_later_mean_s",
                peer,
                f"vllm.{workload}.{config}.ttft_later_turns_vs_{peer}",
                "turns 2-6 only: the requests a cache can serve (every first turn is cold)",
            )
            ratio(
                workload,
                config,
                "throughput_tok_s",
                peer,
                f"vllm.{workload}.{config}.throughput_vs_{peer}",
                TARGETS[f"throughput_vs_vllm.{config}"],
            )
        ratio(
            "longdoc",
            config,
            "ttft_mean_s",
            peer,
            f"vllm.longdoc.{config}.ttft_vs_{peer}",
            "documents asked again after they left vLLM's KV space",
        )
        ratio("longdoc", config, "throughput_tok_s", peer, f"vllm.longdoc.{config}.throughput_vs_{peer}", "")
    ratio(
        "nohit",
        "strata_host_tp2",
        "ttft_mean_s",
        "vllm_tp2",
        "vllm.nohit.strata_tp2.ttft_vs_vllm_tp2",
        TARGETS["nohit"],
    )
    if "multiturn.c4" in results.get(FROM_TP2, {}):
        rows.append(
            Row(
                f"vllm.multiturn.c4.{FROM_TP2}.cached_share",
                results[FROM_TP2]["multiturn.c4"]["cached_share"],
                "x",
                note="prompt tokens not computed by a one-rank server, of sessions two ranks stored",
            )
        )
    ratio(
        "multiturn.c4",
        FROM_TP2,
        "ttft_mean_s",
        "vllm",
        f"vllm.multiturn.c4.{FROM_TP2}.ttft_vs_vllm",
        "the same sessions, vLLM alone at one rank meeting them first",
    )
    ratio(
        "multiturn.c4",
        "strata_host",
        "ttft_mean_s",
        "example",
        "vllm.multiturn.c4.strata_host.ttft_vs_example",
        TARGETS["ttft_vs_example"],
    )
    ratio("nohit", "strata_host", "ttft_mean_s", "vllm", "vllm.nohit.strata.ttft_vs_vllm", TARGETS["nohit"])
    for workload in ("multiturn.c4", "multiturn.c8", "longdoc"):
        ratio(workload, "floor", "ttft_mean_s", "vllm", f"vllm.{workload}.floor.ttft_vs_vllm", TARGETS["floor"])
        for config in ("strata_host", "strata_disk"):
            ratio(
                workload,
                config,
                "ttft_mean_s",
                "floor",
                f"vllm.{workload}.{config}.ttft_vs_floor",
                "1.0 = as fast as if vLLM's KV space held every session",
            )
        ratio(
            workload,
            "floor_tp2",
            "ttft_mean_s",
            "vllm_tp2",
            f"vllm.{workload}.floor_tp2.ttft_vs_vllm_tp2",
            TARGETS["floor"],
        )
        ratio(
            workload,
            "strata_host_tp2",
            "ttft_mean_s",
            "floor_tp2",
            f"vllm.{workload}.strata_host_tp2.ttft_vs_floor_tp2",
            "1.0 = as fast as if vLLM's KV space held every session, at two ranks",
        )
    return rows


def rag_rows(results: dict[str, dict[str, dict[str, float]]]) -> list[Row]:
    """The RAG workload's rows: each configuration's reused tokens and accuracy, and fragment reuse
    against vLLM alone and against prefix reuse only (TTFT and reused tokens: ratios; accuracy:
    points lost)."""
    rows: list[Row] = []
    rag = {config: workloads["rag"] for config, workloads in results.items() if "rag" in workloads}
    for config, numbers in rag.items():
        rows.append(
            Row(
                f"vllm.rag.{config}.reused_tokens",
                numbers["cached_tokens_mean"],
                "tok",
                note="prompt tokens not computed, mean per measured prompt",
            )
        )
        if "accuracy_pct" in numbers:
            rows.append(
                Row(
                    f"vllm.rag.{config}.accuracy_pct",
                    numbers["accuracy_pct"],
                    "%",
                    note=f"trained fixture, {numbers['accuracy_reused_tokens']:.0f} prompt tokens reused per question",
                )
            )
    blend = rag.get("strata_blend")
    if blend is None:
        return rows
    for peer in ("vllm", "strata_host"):
        theirs = rag.get(peer)
        if theirs is None:
            continue
        rows.append(
            Row(
                f"vllm.rag.strata_blend.ttft_vs_{peer}",
                blend["ttft_mean_s"] / theirs["ttft_mean_s"],
                "x",
                baseline=f"vllm.rag.{peer}.ttft_mean_s",
                note=TARGETS[f"rag.ttft_vs_{'vllm' if peer == 'vllm' else 'strata_host'}"],
            )
        )
        reused = theirs["cached_tokens_mean"]
        rows.append(
            Row(
                f"vllm.rag.strata_blend.reused_vs_{peer}",
                blend["cached_tokens_mean"] / max(reused, 1.0),
                "x",
                baseline=f"vllm.rag.{peer}.reused_tokens",
                note=TARGETS["rag.reused_vs_strata_host"] if peer == "strata_host" else "",
            )
        )
        if "accuracy_pct" in blend and "accuracy_pct" in theirs:
            rows.append(
                Row(
                    f"vllm.rag.strata_blend.accuracy_delta_pts_vs_{peer}",
                    theirs["accuracy_pct"] - blend["accuracy_pct"],
                    "pts",
                    baseline=f"vllm.rag.{peer}.accuracy_pct",
                    note=TARGETS["rag.accuracy_delta_pts"],
                )
            )
    return rows
