"""vLLM serving: one vLLM OpenAI server per configuration, driven through the seeds' workloads by an
openai-client driver (prompts as token ids, streamed answers, client-side TTFT).

Configurations, each a fresh server on the same checkpoint and KV space:

    vllm          vLLM alone (its own prefix cache in its KV space)
    example       vLLM + ExampleConnector, vLLM's reference storage connector, on the same disk
    strata_host   vLLM + StrataConnector writing back to the host tier (a node: strata_node --engine vllm)
    strata_disk   vLLM + StrataConnector writing back to the disk tier
    floor         vLLM alone with a KV space that holds every session (nothing is evicted, no
                  request waits for room): a bound no KV offload reaches on the same workloads
    vllm_tp2, strata_host_tp2, floor_tp2
                  vLLM alone, vLLM + StrataConnector (host) and the floor at tensor parallel 2, one
                  core per rank (the other configurations compute on both cores in one rank)

Workloads (every prompt unique to its workload, so one server runs them all in turn):

    multiturn     conversations of a private context and turns of a user message and the answer,
                  the next turn asked when the answer is in, conversations taken round-robin by the
                  clients: between two turns of one conversation the others fill the KV space.
    longdoc       documents asked once, then asked again after the others pushed them out of
                  vLLM's KV space; the second asks are measured.
    nohit         unique prompts, nothing to reuse: what the connector costs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
CONFIGS = ("vllm", "example", "strata_host", "strata_disk", "floor", "vllm_tp2", "strata_host_tp2", "floor_tp2")
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""vLLM's CPU backend at tensor parallel 2 on this machine kind: one core for each rank."""


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
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tokens(count: int, seed: int) -> list[int]:
    """A prompt piece of byte-tokenizer ids (printable bytes), reproducible from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(35, 130) for _ in range(count)]


@dataclasses.dataclass
class Outcome:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    step: int = 0
    """The request's place in its session (0: a conversation's first turn, which nothing precedes)."""


# -- the servers -----------------------------------------------------------------------------------
class Server:
    """One vLLM OpenAI server of a configuration, started and stopped with its process group."""

    def __init__(
        self,
        config: str,
        *,
        checkpoint: Path,
        shape: Shape,
        scratch: Path,
        env: dict[str, str],
        logs: Path,
        label: str = "",
        after: Server | None = None,
        port: int = 0,
        status_port: int = 0,
    ) -> None:
        """`after`: a stopped Strata server whose node (name, host pool, disk) this one serves as,
        to read what it stored; `label` names the run in logs and results (default: config);
        `port` and `status_port` (the connector's endpoints): 0 for a free one each."""
        self.config = config
        self.label = label or config
        port = port or free_port()
        status_port = status_port or free_port()
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{self.label}.log"
        pages = shape.floor_pages if config.startswith("floor") else shape.pages
        self.ranks = 2 if config.endswith("_tp2") else 1
        vllm_args = [
            "--max-model-len",
            str(shape.max_model_len),
            "--num-gpu-blocks-override",
            str(pages),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            *(["--tensor-parallel-size", str(self.ranks)] if self.ranks > 1 else []),
        ]
        # vLLM's CPU backend keeps cores out of its compute for its scheduler process: one alone,
        # two with a KV connector, and where the machine has no more than that, none. Left to
        # itself on 2 cores, vLLM alone would compute on one core and every connector on two;
        # every configuration computes on every core here, as a GPU's compute is the same for all.
        self.env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        if self.ranks > 1:
            self.env.update(TWO_RANKS)
        self.shm_before: set[Path] = set()
        self.node: str | None = None
        """The node a Strata configuration serves as (it runs on that node's own database credential)."""
        self.pool: str | None = None
        self.admin_key = ""
        """The key of the node's request timelines (Strata configurations)."""
        """The node's host pool in /dev/shm (Strata configurations): a node keeps it for its next
        start, a benchmark server has none, so it is removed with the server."""
        if config.startswith("strata_"):
            tier = config.removeprefix("strata_").removesuffix("_tp2")
            name = after.node if after is not None and after.node else f"bench-{config.replace('_', '-')}"
            self.command = [
                sys.executable,
                "manage.py",
                "strata_node",
                "--name",
                name,
                "--engine",
                "vllm",
                "--model",
                str(checkpoint),
                "--serve-port",
                str(port),
                "--status-port",
                str(status_port),
                "--tiers",
                tier,
                "--disk-path",
                str(scratch / f"{name}-disk"),
                "--disk-bytes",
                "8GiB",
                "--host-bytes",
                "3GiB",
                "--heartbeat-seconds",
                "5",
            ]
            self.node = name
            self.pool = after.pool if after is not None and after.pool else f"strata-{name}-{os.getpid()}"
            self.admin_key = secrets.token_urlsafe(24)
            self.env.update(
                STRATA_VLLM_ARGS=" ".join(vllm_args),
                STRATA_HOST_POOL_NAME=self.pool,
                STRATA_NODE_ADMIN_KEY=self.admin_key,
            )
        else:
            self.command = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(checkpoint),
                "--port",
                str(port),
                "--dtype",
                shape.dtype,
                *vllm_args,
            ]
            if config == "example":
                storage = scratch / "example-storage"
                storage.mkdir(parents=True, exist_ok=True)
                self.command += [
                    "--kv-transfer-config",
                    json.dumps(
                        {
                            "kv_connector": "ExampleConnector",
                            "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                        }
                    ),
                ]
        self.process: subprocess.Popen[bytes] | None = None
        self.model = str(checkpoint)
        self.status = f"http://127.0.0.1:{status_port}" if config.startswith("strata_") else None
        self.logs = logs

    def __enter__(self) -> Server:
        try:
            return self._start()
        except BaseException:
            self.__exit__()  # a server that never answered is stopped, and its pool removed, too
            raise

    def _start(self) -> Server:
        self.shm_before = set(SHM.glob("psm_*"))
        if self.node is not None:
            self.env["DATABASE_URL"] = node_database_url(self.node, env=self.env, directory=self.logs / "credentials")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the {self.config} server exited at start (code {self.process.returncode}); "
                    f"see {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=5) as answer:
                    self.model = json.loads(answer.read())["data"][0]["id"]
                    return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"the {self.config} server did not answer within 600 s; see {self.log_path}")

    def keep_traces(self) -> Path | None:
        """The connector's request timelines (lookup, per-layer stall, load and save counts, TTFT
        as the connector saw it) written beside the server's log, for reading a run afterwards."""
        if self.status is None:
            return None
        request = urllib.request.Request(
            self.status + "/v1/strata/requests?limit=1000", headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            path = self.logs / f"{self.label}-requests.json"
            path.write_bytes(answer.read())
        return path

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop()
        finally:
            if self.pool is not None:
                for path in SHM.glob(f"{self.pool}*"):
                    path.unlink(missing_ok=True)
            # vLLM's shared-memory queues (hundreds of MiB) outlive it when a process of the group
            # ends before their owner unlinks them: those it made and nobody maps any more go too.
            mapped = _mapped_shm()
            for path in set(SHM.glob("psm_*")) - self.shm_before:
                if path.name not in mapped:
                    path.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop the server's processes, keeping its node's host pool for a server started after it."""
        self._stop()

    def _stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        # vLLM's engine processes are in the group too: make sure none outlives the run.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def node_database_url(node: str, *, env: dict[str, str], directory: Path) -> str:
    """The DATABASE_URL of node `node`'s own database role, issued with the control plane's
    credential in `env` (`manage.py strata_node_credential`): a node refuses to start on the
    owner's credential, as an operator's would."""
    subprocess.run(
        [sys.executable, "manage.py", "strata_node_credential", node, "--url-dir", str(directory)],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return (directory / f"{node}.url").read_text().strip()


def _mapped_shm() -> set[str]:
    """Names of the /dev/shm files some process maps now."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            names.update(
                line.rsplit("/dev/shm/", 1)[1].split()[0]
                for line in maps.read_text().splitlines()
                if "/dev/shm/" in line
            )
    return names


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- the driver ------------------------------------------------------------------------------------
Step = Callable[[list[int]], tuple[list[int], int]]
"""Given the conversation so far (prompt and answer ids of its last turn), the next prompt and its
answer length."""


def complete(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
    """One streamed completion of token ids: its timings and the answer's ids."""
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
            if (ids or choice.text) and first is None:
                first = time.perf_counter()
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


def drive(base: str, model: str, sessions: Sequence[Sequence[Step]], clients: int) -> tuple[list[Outcome], float]:
    """Run every session's steps in order, each after the previous one's answer; `clients` requests
    in flight at once, the ready steps taken round-robin across sessions. Returns the outcomes and
    the wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=900, max_retries=0)
    ready: collections.deque[tuple[int, int, list[int]]] = collections.deque((i, 0, []) for i in range(len(sessions)))
    lock = threading.Condition()
    in_flight = 0
    outcomes: list[Outcome] = []
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal in_flight
        while True:
            with lock:
                while not ready and in_flight and not errors:
                    lock.wait()
                if not ready or errors:
                    lock.notify_all()
                    return
                session, step, history = ready.popleft()
                in_flight += 1
            try:
                prompt, max_tokens = sessions[session][step](history)
                outcome, answer = complete(client, model, prompt, max_tokens)
                outcome.step = step
            except BaseException as exc:  # noqa: BLE001 - handed to the caller once every client stops
                with lock:
                    errors.append(exc)
                    in_flight -= 1
                    lock.notify_all()
                return
            with lock:
                outcomes.append(outcome)
                in_flight -= 1
                if step + 1 < len(sessions[session]):
                    ready.append((session, step + 1, prompt + answer))
                lock.notify_all()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outcomes, time.perf_counter() - started


# -- the workloads -----------------------------------------------------------------------------------
def multiturn_sessions(shape: Shape, seed: int) -> list[list[Step]]:
    def session(index: int) -> list[Step]:
        context = [1, *tokens(shape.context_tokens, seed=seed * 1000 + index)]

        def turn(number: int) -> Step:
            def make(history: list[int]) -> tuple[list[int], int]:
                user = tokens(shape.user_tokens, seed=seed * 1000 + 100 * index + number + 1)
                return (history or context) + user, shape.answer_tokens

            return make

        return [turn(t) for t in range(shape.turns)]

    return [session(i) for i in range(shape.conversations)]


def longdoc_sessions(shape: Shape, seed: int, ask: int) -> list[list[Step]]:
    """One single-step session per document: its `ask`-th question about it."""

    def ask_doc(doc: int) -> list[Step]:
        document = [1, *tokens(shape.document_tokens, seed=seed * 1000 + doc)]
        question = tokens(shape.question_tokens, seed=seed * 1000 + 100 + 10 * doc + ask)
        return [lambda _history: (document + question, shape.doc_answer_tokens)]

    return [ask_doc(d) for d in range(shape.documents)]


def nohit_sessions(shape: Shape, seed: int) -> list[list[Step]]:
    def one(index: int) -> list[Step]:
        prompt = [1, *tokens(shape.nohit_tokens, seed=seed * 1000 + index)]
        return [lambda _history: (prompt, shape.nohit_answer_tokens)]

    return [one(i) for i in range(shape.nohit_requests)]


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
        "wall_s": wall,
        "requests": float(len(outcomes)),
    }


SKIPPED = {
    "example": {
        "longdoc": "ExampleConnector saves only a prompt's first prefill chunk (2048 tokens here) and "
        "kills vLLM's engine when it loads such a prompt back (vLLM 0.32: a shape mismatch "
        "in inject_kv_into_layer)"
    }
}
"""Workloads a configuration cannot serve, and why."""


def run_config(
    server: Server, shape: Shape, progress: Callable[[str], None], *, replay: bool = False
) -> dict[str, dict[str, float]]:
    """Every workload against one server; per workload, its summary. A fresh server compiles its
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
        sessions = multiturn_sessions(shape, seed=10 + clients)
        progress(
            f"vllm: {server.label}: multi-turn, {clients} clients, {shape.conversations} conversations x "
            f"{shape.turns} turns"
        )
        results[f"multiturn.c{clients}"] = summary(*drive(server.base, server.model, sessions, clients))
    skipped = SKIPPED.get(server.config, {})
    if "longdoc" in skipped:
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
    progress(f"vllm: {server.label}: {shape.nohit_requests} prompts with nothing to reuse")
    results["nohit"] = summary(*drive(server.base, server.model, nohit_sessions(shape, seed=40), clients=4))
    kept = server.keep_traces()
    if kept is not None:
        progress(f"vllm: {server.label}: the connector's request timelines are in {kept}")
    return results
