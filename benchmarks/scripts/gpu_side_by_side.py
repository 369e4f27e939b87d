"""Side by side on one CUDA GPU: vLLM alone, with OffloadingConnector, with LMCache, with Strata.

Each serves the same multi-turn and long-document workloads through vLLM's OpenAI server.

On the GPU machine (PyPI reachable), from the repository root, two commands:

    python3 -m benchmarks.scripts.gpu_side_by_side install   # about 3-6 min: a venv at /tmp/strata-gpu-venv
    python3 -m benchmarks.scripts.gpu_side_by_side run       # at most 8 min (--minutes), then one table

Expected total: under 15 minutes. `run` re-executes itself under the venv's python; neither command
needs a terminal. Both print every command they run and a progress line at least every 15 s; `run`
prints the path of its results JSON first and writes it again after each configuration; it exits
0 when every configuration was measured, else 1 (the table says why).
`python3 -m benchmarks.scripts.gpu_side_by_side plan` prints the servers' commands and environment
without starting anything (checked on CPU by tests/connectors/test_gpu_script.py).
`python3 -m benchmarks.scripts.gpu_side_by_side checks` (after `install`, under a minute) runs the
connector's tests that need CUDA (`CUDA_CHECKS`: the order of a GPU's layer-wise save copies
against the next step's kernels, the page geometry of CUDA tensors); it exits 1 without a GPU.

Configurations (one fresh server each, in turn, on the same checkpoint and KV space; each with
the same CPU capacity, --cpu-gib):

    vllm        vLLM alone, its prefix cache in HBM
    offloading  vLLM's OffloadingConnector: CPU offload (cpu_bytes_to_use)
    lmcache     LMCacheConnectorV1 with LMCache's local CPU backend (LMCACHE_* variables)
    strata      StrataConnectorBase writing back to Strata's host tier (no directory, no database)
    strata_blend  the same with fragment reuse on: the RAG workload only (vllm and strata run it
                too, first): the blended loads' CUDA path, the recompute eager before the forward

The checkpoint is the `bench` preset (hidden 1024, 8 layers, 4 kv heads, bf16, random weights, a
byte-level tokenizer: nothing downloaded), 8 KiB of KV per token, on FLASH_ATTN. vLLM's KV space
holds as many tokens as the CPU suite's (benchmarks.workloads.sessions.Shape.pages, pages of 128
tokens there), in pages of 16, so that the sessions overflow it as a full HBM does; `plan` prints
it. The workloads are benchmarks/workloads/sessions.py's at scale 1, sent by the `vllm` suite's
driver (benchmarks.workloads.vllm_api.drive): a warm-up of untimed prompts no workload shares,
RAG (vllm, strata and strata_blend: the corpus read, then the prompts asked alone, measured),
multi-turn (Shape's conversations and turns, 4 clients), then the long documents asked once and
again after the others pushed them out of the KV space, the second asks measured.

Budget: a configuration starts only while the time left covers the longest one so far (a guess
before the first); the rest are skipped, saying so. A configuration still running when the budget
ends is stopped and its row says so. On one GPU the servers run eager (no torch.compile, no CUDA
graphs) to keep their start near half a minute: TPOT is then eager-mode for every row alike
(--cuda-graphs to compile, when the budget allows). Where the machine has two GPUs every server
runs at tensor parallel 2 with CUDA graphs on (--tensor-parallel, --no-cuda-graphs to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.runtime.servers import REPO_ROOT, Server, ServerSpec, StartFailed, error_line, free_port, tail
from benchmarks.workloads.sessions import (
    Shape,
    TokenStep,
    longdoc_sessions,
    multiturn_sessions,
    rag_sessions,
    summary,
    tokens,
)
from benchmarks.workloads.vllm_api import drive

MODULE = "benchmarks.scripts.gpu_side_by_side"
"""How the script runs: `python3 -m` this, from the repository root."""
CONFIGS = ("vllm", "offloading", "lmcache", "strata", "strata_blend")
DESCRIPTIONS = {
    "vllm": "vLLM alone (prefix caching on)",
    "offloading": "vLLM's OffloadingConnector (CPU offload)",
    "lmcache": "LMCacheConnectorV1 (LMCache, local CPU backend)",
    "strata": "StrataConnectorBase (Strata's host tier, no directory)",
    "strata_blend": "StrataConnectorBase with fragment reuse (STRATA_BLEND): the RAG workload only",
}
RAG_CONFIGS = ("vllm", "strata", "strata_blend")
"""The configurations that run the RAG workload (benchmarks.workloads.sessions.rag_sessions)."""
VLLM_VERSION = "0.32.0"
LMCACHE_VERSION = "0.5.6"
"""The LMCache release installed: its vLLM adapter's imports all exist in vLLM 0.32 (checked by
reading them; `install` imports it and says so if it does not load)."""
RUNTIME_DEPS = ("xxhash", "psutil", "PyYAML", "prometheus-client", "numpy", "rich", "openai", "redis", "pytest")
"""What this driver imports beyond vLLM's and Strata's own dependencies; the repository itself goes
in with its dependencies' ranges, held to the torch and vLLM that vLLM brought (the constraints)."""
CUDA_CHECKS = ("tests/connectors/test_gpu_ordering.py",)
"""The connector's test modules whose CUDA cases `checks` runs (each needs no conftest)."""
DEFAULT_VENV = Path("/tmp/strata-gpu-venv")
DEFAULT_SCRATCH = Path("/tmp/strata-gpu-bench")

SHAPE = Shape()
SHAPE_PAGE_TOKENS = 128
"""The page Shape.pages counts in (vLLM's CPU backend's)."""
KV_SPACE_TOKENS = SHAPE.pages * SHAPE_PAGE_TOKENS
PAGE_TOKENS = 16
"""vLLM's page on CUDA, given explicitly so the KV space does not follow the attention backend."""
ATTENTION_BACKEND = "FLASH_ATTN"
"""Named for every row alike: Strata reads FLASH_ATTN's pages (connectors/pages.py), not FlashInfer's."""
PAGES = KV_SPACE_TOKENS // PAGE_TOKENS
STRATA_BLOCK_TOKENS = 256
"""Strata's block_tokens default; LMCache's chunk is set to it so both store whole 256-token runs."""
WARM_PROMPT_TOKENS = (SHAPE.context_tokens, 300, SHAPE.document_tokens // 2)

START_TIMEOUT_S = 300.0
FIRST_ESTIMATE_S = {True: 100.0, False: 200.0}
"""Guessed wall time of one configuration (start, workloads, stop) before one has run, eager or not."""
FINISH_RESERVE_S = 20.0
"""Kept back from the budget for the last server's stop, the table and the JSON."""
PROGRESS_EVERY_S = 15.0

COMMON_ENV = {
    "PYTHONUNBUFFERED": "1",
    # The GPU machine reaches PyPI only: no usage reports, no hub lookups to wait out.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


class Log:
    """Progress lines stamped with the seconds since the command started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def command(self, command: Sequence[str], env: dict[str, str] | None = None) -> None:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        self.say("$ " + (prefix + " " if prefix else "") + shlex.join(command))


class Ticker:
    """Calls `say(describe())` every PROGRESS_EVERY_S seconds while its block runs."""

    def __init__(self, log: Log, describe: Callable[[], str]) -> None:
        self.log, self.describe = log, describe
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    def _tick(self) -> None:
        while not self.stopped.wait(PROGRESS_EVERY_S):
            self.log.say(self.describe())

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


# -- the configurations ------------------------------------------------------------------------------
def server_spec(
    config: str,
    *,
    python: str,
    checkpoint: str,
    port: int,
    status_port: int,
    cpu_bytes: int,
    eager: bool,
    pool_name: str,
    tensor_parallel: int = 1,
) -> ServerSpec:
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(SHAPE.max_model_len),
        "--block-size",
        str(PAGE_TOKENS),
        "--attention-backend",
        ATTENTION_BACKEND,
        "--num-gpu-blocks-override",
        str(PAGES),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--gpu-memory-utilization",
        "0.5",
        "--seed",
        "0",
    ]
    if eager:
        command.append("--enforce-eager")
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel)]
    env = dict(COMMON_ENV)
    transfer: dict[str, Any] | None = None
    leftovers: tuple[str, ...] = ()
    if config == "offloading":
        # vllm/v1/kv_offload/cpu/spec.py reads cpu_bytes_to_use (required); the chunk stays vLLM's
        # default of one page, as `--kv-offloading-size` would configure it.
        transfer = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
        }
        leftovers = ("vllm_offload_*.mmap",)
    elif config == "lmcache":
        # LMCache reads its engine config from LMCACHE_* variables (LMCacheEngineConfig.from_env)
        # when LMCACHE_CONFIG_FILE is unset; max_local_cpu_size is in GiB.
        transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        env.update(
            LMCACHE_CHUNK_SIZE=str(STRATA_BLOCK_TOKENS),
            LMCACHE_LOCAL_CPU="true",
            LMCACHE_MAX_LOCAL_CPU_SIZE=f"{cpu_bytes / 2**30:g}",
            LMCACHE_TRACK_USAGE="false",
        )
    elif config in ("strata", "strata_blend"):
        transfer = {
            "kv_connector": "StrataConnectorBase",
            "kv_connector_module_path": "worker.dataplane.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "node_name": "gpu-bench",
                "tiers": "host",
                "host_bytes": cpu_bytes,
                "host_pool_name": pool_name,
                "status_port": status_port,
                "blend": config == "strata_blend",
            },
        }
        leftovers = (f"{pool_name}*",)
    elif config != "vllm":
        raise ValueError(f"unknown configuration {config!r}; expected one of {', '.join(CONFIGS)}")
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return ServerSpec(config=config, command=command, env=env, shm_leftovers=leftovers)


def gpu_count() -> int:
    """The GPUs `nvidia-smi -L` lists (0 without one)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {value!r}")
    return number


def parse_configs(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown)}; expected any of {', '.join(CONFIGS)}"
        )
    if len(set(names)) != len(names) or not names:
        raise argparse.ArgumentTypeError(f"expected configurations listed once each, got {value!r}")
    return names


# -- the workloads -----------------------------------------------------------------------------------
class Counted:
    """A workload's sessions, counting the requests sent (each step called is one request)."""

    def __init__(self, sessions: Sequence[Sequence[TokenStep]]) -> None:
        self.total = sum(len(session) for session in sessions)
        self.sent = 0
        self.lock = threading.Lock()
        self.sessions = [[self._counting(step) for step in session] for session in sessions]

    def _counting(self, step: TokenStep) -> TokenStep:
        def counted(history: list[int] | None) -> tuple[list[int], int]:
            with self.lock:
                self.sent += 1
            return step(history)

        return counted


def single(prompt: list[int], max_tokens: int) -> list[TokenStep]:
    return [lambda _history: (prompt, max_tokens)]


def measure(server: Server, model: str, log: Log) -> dict[str, dict[str, float]]:
    """The warm-up, then the measured workloads; per workload, its summary."""
    name = server.spec.config

    def workload(label: str, sessions: Sequence[Sequence[TokenStep]], clients: int) -> tuple[list[Any], float]:
        counted = Counted(sessions)
        log.say(f"{name}: {label} ({counted.total} requests, {clients} clients)")
        with Ticker(log, lambda: f"{name}: {label}: {counted.sent}/{counted.total} requests sent"):
            outcomes, wall = drive(server.base, model, counted.sessions, clients)
        log.say(f"{name}: {label} done in {wall:.1f} s")
        return outcomes, wall

    warm = [single([1, *tokens(n, seed=900 + i)], 8) for i, n in enumerate(WARM_PROMPT_TOKENS)]
    workload("warm-up", warm, clients=2)
    results: dict[str, dict[str, float]] = {}
    if name in RAG_CONFIGS:
        corpus, asked = rag_sessions(SHAPE, seed=50)
        workload(f"RAG, the corpus of {SHAPE.rag_corpus} passages read", corpus, clients=1)
        time.sleep(2.0)  # Strata's save queue stores the corpus's blocks outside the step
        results["rag"] = summary(*workload(f"RAG, {len(asked)} prompts asked alone (measured)", asked, clients=1))
    if name == "strata_blend":
        return results
    results |= {
        "multiturn.c4": summary(
            *workload(
                f"multi-turn, {SHAPE.conversations} conversations x {SHAPE.turns} turns",
                multiturn_sessions(SHAPE, seed=14),
                clients=4,
            )
        )
    }
    workload(
        f"long documents, first asks ({SHAPE.documents} x {SHAPE.document_tokens} tokens)",
        longdoc_sessions(SHAPE, seed=30, ask=0),
        clients=1,
    )
    results["longdoc"] = summary(
        *workload("long documents, asked again (measured)", longdoc_sessions(SHAPE, seed=30, ask=1), clients=1)
    )
    return results


# -- the commands ------------------------------------------------------------------------------------
def cpu_space(gib: float, log: Log) -> int:
    """The CPU capacity every offloading configuration gets: `gib`, less where /dev/shm (which
    the OffloadingConnector's region and Strata's host pool live in) cannot hold it."""
    wanted = int(gib * 2**30)
    free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else wanted
    if wanted + 2**28 > free:
        fitted = max(2**30, int(free * 0.8) // 2**30 * 2**30)
        log.say(f"/dev/shm has {free / 2**30:.1f} GiB free: CPU capacity {fitted / 2**30:g} GiB instead of {gib:g}")
        return fitted
    return wanted


def make_checkpoint(path: Path, log: Log) -> Path:
    if (path / "config.json").is_file():
        log.say(f"checkpoint: {path} (saved by an earlier run)")
        return path
    command = [
        sys.executable,
        "-c",
        "import sys; from worker.dataplane.models.loading import save_preset; save_preset('bench', sys.argv[1])",
        str(path),
    ]
    log.command(command)
    began = time.monotonic()
    with Ticker(log, lambda: f"checkpoint: saving ({time.monotonic() - began:.0f} s)"):
        code = subprocess.run(command, cwd=REPO_ROOT).returncode
    if code != 0:
        raise SystemExit(f"checkpoint: saving the bench preset to {path} failed (exit {code}); its output is above")
    return path


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in ("vllm", "torch", "lmcache", "strata"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_name(log: Log) -> str:
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    command = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    log.command(command)
    answer = subprocess.run(command, capture_output=True, text=True)
    return answer.stdout.strip() or answer.stderr.strip()


def run_one(
    config: str,
    *,
    checkpoint: Path,
    scratch: Path,
    cpu_bytes: int,
    eager: bool,
    tensor_parallel: int,
    deadline: float,
    log: Log,
) -> dict[str, Any]:
    port = free_port()
    spec = server_spec(
        config,
        python=sys.executable,
        checkpoint=str(checkpoint),
        port=port,
        status_port=free_port(),
        cpu_bytes=cpu_bytes,
        eager=eager,
        pool_name=f"strata-gpu-bench-{os.getpid()}",
        tensor_parallel=tensor_parallel,
    )
    log.say(f"== {config}: {DESCRIPTIONS[config]}")
    server = Server(spec, log_path=scratch / f"{config}.log", port=port, stop_grace=15.0)
    log.command(spec.command, spec.env)
    log.say(f"{config}: log {server.log_path}")
    row: dict[str, Any] = {"status": "ok", "command": spec.command, "env": spec.env, "log": str(server.log_path)}
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), server.kill_for_budget)
    watchdog.daemon = True
    watchdog.start()
    began = time.monotonic()
    try:
        model = server.start(min(START_TIMEOUT_S, deadline - time.monotonic()), log.say)
        row["start_s"] = time.monotonic() - began
        row["workloads"] = measure(server, model, log)
    except Exception as exc:  # noqa: BLE001 - one configuration failing must not stop the others
        if server.killed_for_budget:
            row.update(status="stopped", reason="stopped: the time budget ran out")
        else:
            kind = "failed to start" if isinstance(exc, StartFailed) else "failed"
            row.update(status="failed", reason=f"{kind}: {exc}; {error_line(server.log_path)}")
        row["log_tail"] = tail(server.log_path)
        log.say(f"{config}: {row['reason']}\n    " + "\n    ".join(row["log_tail"]))
    finally:
        watchdog.cancel()
        server.close()
    row["wall_s"] = time.monotonic() - began
    log.say(f"{config}: {row['status']} after {row['wall_s']:.0f} s")
    return row


def ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each measured row's TTFT, TPOT and throughput divided by vLLM alone's, per workload."""
    base = rows.get("vllm", {}).get("workloads")
    for row in rows.values():
        if not base or "workloads" not in row:
            continue
        row["ratios"] = {}
        for workload, got in row["workloads"].items():
            ref = base.get(workload)
            if ref is None:  # vLLM alone did not run it
                continue
            row["ratios"][workload] = {
                key: (got[key] / ref[key] if ref[key] else None)
                for key in ("ttft_mean_s", "tpot_ms", "throughput_tok_s")
            }


def table(rows: dict[str, dict[str, Any]]) -> str:
    header = (
        "config",
        "workload",
        "TTFT ms",
        "TPOT ms",
        "tok/s",
        "cached",
        "TTFT/vllm",
        "TPOT/vllm",
        "tok/s/vllm",
        "status",
    )
    lines = [header]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for config, row in rows.items():
        if "workloads" not in row:
            lines.append((config, "-", "-", "-", "-", "-", "-", "-", "-", row.get("reason", row["status"])[:160]))
            continue
        for workload, got in row["workloads"].items():
            rel = row.get("ratios", {}).get(workload, {})
            lines.append(
                (
                    config,
                    workload,
                    f"{got['ttft_mean_s'] * 1000:.1f}",
                    f"{got['tpot_ms']:.2f}",
                    f"{got['throughput_tok_s']:.0f}",
                    f"{got['cached_share']:.2f}",
                    ratio(rel.get("ttft_mean_s")),
                    ratio(rel.get("tpot_ms")),
                    ratio(rel.get("throughput_tok_s")),
                    row["status"],
                )
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in lines
    )


def in_venv(venv: Path, log: Log) -> None:
    """Go on under the venv's python: re-execute this command there unless it already runs there."""
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--venv {venv}: no python there; run `python3 -m {MODULE} install` first")
    command = [str(python), "-m", MODULE, *sys.argv[1:]]
    log.command(command)
    os.chdir(REPO_ROOT)  # where `-m` finds the benchmarks package
    os.execv(command[0], command)


def run(args: argparse.Namespace) -> int:
    log = Log()
    in_venv(args.venv, log)
    deadline = log.started + args.minutes * 60 - FINISH_RESERVE_S
    scratch = args.scratch / time.strftime("%Y%m%d-%H%M%S")
    scratch.mkdir(parents=True, exist_ok=True)
    out = args.out or scratch / "results.json"
    log.say(f"results: {out}; logs: {scratch}; budget {args.minutes:g} min")
    cpu_bytes = cpu_space(args.cpu_gib, log)
    report: dict[str, Any] = {
        "gpu": gpu_name(log),
        "versions": versions(),
        "eager": not args.cuda_graphs,
        "minutes": args.minutes,
        "cpu_bytes": cpu_bytes,
        "pages": PAGES,
        "page_tokens": PAGE_TOKENS,
        "shape": dataclasses.asdict(SHAPE),
        "configs": {},
    }
    log.say(f"gpu: {report['gpu']}; versions: {report['versions']}")
    checkpoint = make_checkpoint(args.scratch / "checkpoints" / "bench", log)
    report["checkpoint"] = str(checkpoint)
    rows: dict[str, dict[str, Any]] = report["configs"]
    longest = 0.0
    for config in args.configs:
        need = longest * 1.1 if longest else FIRST_ESTIMATE_S[not args.cuda_graphs]
        left = deadline - time.monotonic()
        if left < need:
            rows[config] = {
                "status": "skipped",
                "reason": f"skipped: {max(0.0, left):.0f} s of the budget left, a configuration takes "
                f"about {need:.0f} s",
            }
            log.say(f"{config}: {rows[config]['reason']}")
            continue
        rows[config] = run_one(
            config,
            checkpoint=checkpoint,
            scratch=scratch,
            cpu_bytes=cpu_bytes,
            eager=not args.cuda_graphs,
            tensor_parallel=args.tensor_parallel,
            deadline=deadline,
            log=log,
        )
        if rows[config]["status"] == "ok":
            longest = max(longest, rows[config]["wall_s"])
        out.write_text(json.dumps(report, indent=2))
    ratios(rows)
    out.write_text(json.dumps(report, indent=2))
    print("\n" + table(rows) + "\n", flush=True)
    measured = sum(row["status"] == "ok" for row in rows.values())
    log.say(f"{measured} of {len(rows)} configurations measured; results: {out}")
    return 0 if measured == len(rows) else 1


def plan(args: argparse.Namespace) -> int:
    """The servers `run` would start, with a placeholder checkpoint; nothing is started."""
    python = str(args.venv / "bin" / "python")
    cpu_bytes = int(args.cpu_gib * 2**30)
    print(f"checkpoint: the bench preset, saved by `run` under {args.scratch / 'checkpoints' / 'bench'}")
    print(
        f"KV space: {PAGES} pages of {PAGE_TOKENS} tokens ({KV_SPACE_TOKENS} tokens); CPU capacity "
        f"{cpu_bytes} bytes; ports are picked free at run time"
    )
    for config in args.configs:
        spec = server_spec(
            config,
            python=python,
            checkpoint="<checkpoint>",
            port=free_port(),
            status_port=free_port(),
            cpu_bytes=cpu_bytes,
            eager=not args.cuda_graphs,
            pool_name="strata-gpu-bench-<pid>",
            tensor_parallel=args.tensor_parallel,
        )
        print(f"\n== {config}: {DESCRIPTIONS[config]}")
        print("env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items()))
        print("command: " + shlex.join(spec.command))
    return 0


def checks(args: argparse.Namespace) -> int:
    """The connector's tests that need CUDA, under the venv's python; 1 without a GPU."""
    log = Log()
    in_venv(args.venv, log)
    import torch

    if not torch.cuda.is_available():
        log.say("checks: torch sees no CUDA GPU here; these tests need one")
        return 1
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "--noconftest", "-p", "no:cacheprovider", *CUDA_CHECKS]
    log.command(command)
    return subprocess.run(command, cwd=REPO_ROOT).returncode


def install(args: argparse.Namespace) -> int:
    log = Log()
    venv: Path = args.venv
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def step(command: list[str], *, required: bool = True) -> bool:
        log.command(command)
        began = time.monotonic()
        # Outside the repository, so the import checks below find it through the editable install.
        with Ticker(log, lambda: f"still running ({time.monotonic() - began:.0f} s): {shlex.join(command)[:100]}"):
            done = subprocess.run(command, env=env, cwd=venv if venv.is_dir() else None).returncode == 0
        log.say(f"{'done' if done else 'FAILED'} in {time.monotonic() - began:.0f} s")
        if required and not done:
            raise SystemExit(f"install: this step failed: {shlex.join(command)}")
        return done

    if not python.exists() and not step([sys.executable, "-m", "venv", str(venv)], required=False):
        step([sys.executable, "-m", "venv", "--without-pip", str(venv)])  # no ensurepip: the outer pip serves
    probe = [str(python), "-m", "pip", "--version"]
    log.command(probe)
    own_pip = subprocess.run(probe, capture_output=True).returncode == 0
    pip = [str(python), "-m", "pip"] if own_pip else [sys.executable, "-m", "pip", "--python", str(python)]
    quiet = ["--progress-bar", "off"]
    step([*pip, "install", *quiet, f"vllm=={VLLM_VERSION}"])
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"]
    log.command(probe)
    torch = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    # Whatever comes after must leave vLLM's own torch (its CUDA build) as it is.
    constraints = venv / "strata-constraints.txt"
    constraints.write_text(f"torch=={torch}\nvllm=={VLLM_VERSION}\n")
    log.say(f"constraints {constraints}: torch=={torch}, vllm=={VLLM_VERSION}")
    lmcache = step([*pip, "install", *quiet, "-c", str(constraints), f"lmcache=={LMCACHE_VERSION}"], required=False)
    step([*pip, "install", *quiet, "-c", str(constraints), *RUNTIME_DEPS])
    step([*pip, "install", *quiet, "-c", str(constraints), "-e", str(REPO_ROOT)])
    step([str(python), "-c", "import worker.dataplane.connectors.vllm as c; print('strata connector', c.__file__)"])
    if lmcache:
        lmcache = step(
            [
                str(python),
                "-c",
                "import lmcache.integration.vllm.vllm_v1_adapter, lmcache.cuda_ops; print('lmcache adapter loads')",
            ],
            required=False,
        )
    if not lmcache:
        log.say(f"lmcache {LMCACHE_VERSION} did not install or load: `run` will report its row as failed")
    cuda = step(
        [
            str(python),
            "-c",
            "import sys, torch, vllm; print('vllm', vllm.__version__, 'torch', "
            "torch.__version__, 'cuda', torch.cuda.is_available()); sys.exit(not torch.cuda.is_available())",
        ],
        required=False,
    )
    if not cuda:
        log.say("torch in the venv sees no GPU (driver too old for its CUDA build?): `run` cannot serve")
    log.say(f"installed in {venv} in {time.monotonic() - log.started:.0f} s; next: python3 -m {MODULE} run")
    return 0 if cuda else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, helped in (
        ("install", "create the GPU venv: vLLM (CUDA), LMCache, this repository"),
        ("run", "start each configuration's server in turn and measure it"),
        ("plan", "print the servers' commands and environment; start nothing"),
        ("checks", "run the connector's tests that need CUDA"),
    ):
        sub = commands.add_parser(name, help=helped)
        sub.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"the GPU venv (default {DEFAULT_VENV})")
        if name in ("install", "checks"):
            continue
        sub.add_argument(
            "--configs",
            type=parse_configs,
            default=list(CONFIGS),
            help=f"comma-separated, run in this order (default {','.join(CONFIGS)})",
        )
        sub.add_argument(
            "--cpu-gib",
            type=positive,
            default=8.0,
            help="CPU capacity of each offloading configuration, GiB (default 8)",
        )
        two = gpu_count() >= 2
        sub.add_argument(
            "--tensor-parallel",
            type=int,
            default=2 if two else 1,
            help="tensor-parallel size of every server (default: 2 where the machine has 2 GPUs, else 1)",
        )
        sub.add_argument(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            default=two,
            help="compile and capture CUDA graphs (slower starts) instead of --enforce-eager (default: on where "
            "the machine has 2 GPUs)",
        )
        sub.add_argument(
            "--scratch",
            type=Path,
            default=DEFAULT_SCRATCH,
            help=f"logs, results and the checkpoint (default {DEFAULT_SCRATCH})",
        )
        if name == "run":
            sub.add_argument("--minutes", type=positive, default=8.0, help="wall-time budget of the run (default 8)")
            sub.add_argument("--out", type=Path, help="results JSON (default: in the run's scratch folder)")
    args = parser.parse_args(argv)
    return {"install": install, "run": run, "plan": plan, "checks": checks}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
