"""Running an OpenAI-API server for a benchmark: one `Server` for every configuration of the
`vllm` and `vllm_stall` suites (vLLM's CPU backend, alone or as a Strata node) and of the GPU
side-by-side script (vLLM on CUDA with each offloading connector).

A server runs in a process group of its own, its output in one log; `start` waits for
`/v1/models`, `stop` ends the whole group (vLLM's engine core and workers hold memory, on a GPU the
device), `close` also removes the /dev/shm files the run left behind. `vllm_cpu_server` builds the
CPU suites' servers from a configuration name."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""vLLM's CPU backend at tensor parallel 2 on this machine kind: one core for each rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """How one configuration's server starts: its command, the variables it adds to the
    environment, and the /dev/shm files it can leave behind (removed after its run, those made
    since it started)."""

    config: str
    command: list[str]
    env: dict[str, str]
    shm_leftovers: tuple[str, ...] = ()


class StartFailed(RuntimeError):
    """The server exited or did not answer in time; the message says which."""


class Server:
    """One configuration's server in a process group of its own, its output in `log_path`."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        log_path: Path,
        port: int,
        label: str = "",
        start_timeout: float = 600.0,
        stop_grace: float = 60.0,
        status: str | None = None,
        admin_key: str = "",
        node: str | None = None,
        pool: str | None = None,
        credentials: Path | None = None,
    ) -> None:
        """`label` names the run in logs and results (default: the configuration); `status` and
        `admin_key`: the connector's status endpoint and its key (Strata nodes); `node`: the node a
        Strata configuration serves as, whose own database credential is issued into
        `credentials` at start; `pool`: its host pool in /dev/shm, kept by `stop` (for a server of
        the same node started after it) and removed by `close`."""
        self.spec = spec
        self.config = spec.config
        self.label = label or spec.config
        self.log_path = log_path
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.model = ""
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.status = status
        self.admin_key = admin_key
        self.node = node
        self.pool = pool
        self.credentials = credentials
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.shm_before: set[Path] = set()
        self.killed_for_budget = False

    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.close()  # a server that never answered is stopped, and its files removed, too
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float | None = None, say: Callable[[str], None] | None = None) -> str:
        """Start it and wait for /v1/models (`timeout`, default the server's); the model id it
        serves. `say` gets the command, then a line every 15 s while it starts."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.shm_before = set(SHM.glob("psm_*"))
        env = {**os.environ, **self.spec.env}
        if self.node is not None and self.credentials is not None:
            env["DATABASE_URL"] = node_database_url(self.node, env=env, directory=self.credentials)
        if say is not None:
            say(f"{self.label}: $ {' '.join(self.spec.command)}; log {self.log_path}")
        self.started_at = time.time()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.spec.command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        limit = self.start_timeout if timeout is None else timeout
        began = time.monotonic()
        told = began
        while time.monotonic() - began < limit:
            if self.process.poll() is not None:
                raise StartFailed(
                    f"the {self.label} server exited at start (code {self.process.returncode}); "
                    f"see {self.log_path}:\n" + "\n".join(tail(self.log_path, 30))
                )
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=5) as answer:
                    self.model = str(json.loads(answer.read())["data"][0]["id"])
                if say is not None:
                    say(f"{self.label}: serving after {time.monotonic() - began:.0f} s")
                return self.model
            except OSError:
                time.sleep(1)
            if say is not None and time.monotonic() - told >= 15:
                told = time.monotonic()
                say(f"{self.label}: starting ({told - began:.0f} s); log: {last_line(self.log_path)[:110]}")
        raise StartFailed(
            f"the {self.label} server did not answer /v1/models within {limit:.0f} s; see {self.log_path}"
        )

    def keep_traces(self) -> Path | None:
        """The connector's request timelines (lookup, per-layer stall, load and save counts, TTFT
        as the connector saw it) written beside the server's log, for reading a run afterwards."""
        if self.status is None:
            return None
        request = urllib.request.Request(
            self.status + "/v1/strata/requests?limit=1000", headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            path = self.log_path.parent / f"{self.label}-requests.json"
            path.write_bytes(answer.read())
        return path

    def kill_for_budget(self) -> None:
        """Kill the server now (a run out of time): its row says it was stopped."""
        self.killed_for_budget = True
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Stop every process of the server's group, keeping its node's host pool for a server
        started after it. The engine core and its workers are in the group too and hold memory (on
        a GPU, the device): this returns once none of them is left."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                process.wait()
        patience, deadline = time.monotonic() + 10, time.monotonic() + 30
        while group_alive(process.pid) and time.monotonic() < deadline:
            if time.monotonic() > patience:
                self._signal(signal.SIGKILL)
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the server and remove what it left in /dev/shm: its node's host pool, the spec's
        leftovers made since it started, and vLLM's shared-memory queues (hundreds of MiB) that
        outlive it when a process of the group ends before their owner unlinks them and that
        nobody maps any more."""
        try:
            self.stop()
        finally:
            if self.pool is not None:
                for path in SHM.glob(f"{self.pool}*"):
                    path.unlink(missing_ok=True)
            for pattern in self.spec.shm_leftovers:
                for path in SHM.glob(pattern):
                    with contextlib.suppress(FileNotFoundError):
                        if path.stat().st_mtime >= self.started_at - 1:  # never another run's files
                            path.unlink()
            mapped = _mapped_shm()
            for path in set(SHM.glob("psm_*")) - self.shm_before:
                if path.name not in mapped:
                    path.unlink(missing_ok=True)

    def _signal(self, signum: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)


class ServingShape(Protocol):
    """What a server's size is read from (a workload's `Shape`): the longest sequence, the pages of
    KV cache vLLM gets (in the usual configurations and in the `floor` ones) and the model's dtype."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def pages(self) -> int: ...
    @property
    def floor_pages(self) -> int: ...
    @property
    def dtype(self) -> str: ...


def vllm_cpu_server(
    config: str,
    *,
    checkpoint: Path,
    shape: ServingShape,
    scratch: Path,
    env: dict[str, str],
    logs: Path,
    label: str = "",
    after: Server | None = None,
    port: int = 0,
    status_port: int = 0,
    page_tokens: int | None = None,
    tokenizer: bool = True,
) -> Server:
    """The server of one configuration of the `vllm` suites (benchmarks.suites.vllm names them) on
    vLLM's CPU backend. `after`: a stopped Strata server whose node (name, host pool, disk) this
    one serves as, to read what it stored; `port` and `status_port` (the connector's endpoints): 0
    for a free one each; `page_tokens`: vLLM's page and Strata's block size (None: vLLM's default
    page, Strata's default block); `tokenizer` False for a checkpoint that ships none (the prompts
    and answers are token ids)."""
    port = port or free_port()
    status_port = status_port or free_port()
    pages = shape.floor_pages if config.startswith("floor") else shape.pages
    ranks = 2 if config.endswith("_tp2") else 1
    vllm_args = [
        "--max-model-len",
        str(shape.max_model_len),
        "--num-gpu-blocks-override",
        str(pages),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *(["--tensor-parallel-size", str(ranks)] if ranks > 1 else []),
        *(["--block-size", str(page_tokens)] if page_tokens else []),
        *([] if tokenizer else ["--skip-tokenizer-init"]),
    ]
    # vLLM's CPU backend keeps cores out of its compute for its scheduler process: one alone,
    # two with a KV connector, and where the machine has no more than that, none. Left to
    # itself on 2 cores, vLLM alone would compute on one core and every connector on two;
    # every configuration computes on every core here, as a GPU's compute is the same for all.
    added = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if ranks > 1:
        added.update(TWO_RANKS)
    label = label or config
    if config.startswith("strata_"):
        tier = config.removeprefix("strata_").removesuffix("_tp2")
        if tier == "blend":  # fragment reuse on a node writing back to the host tier
            tier = "host"
            added["STRATA_BLEND"] = "true"
        if page_tokens:
            added["STRATA_BLOCK_TOKENS"] = str(page_tokens)
        name = after.node if after is not None and after.node else f"bench-{config.replace('_', '-')}"
        pool = after.pool if after is not None and after.pool else f"strata-{name}-{os.getpid()}"
        admin_key = secrets.token_urlsafe(24)
        command = [
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
        added.update(STRATA_VLLM_ARGS=" ".join(vllm_args), STRATA_HOST_POOL_NAME=pool, STRATA_NODE_ADMIN_KEY=admin_key)
        return Server(
            ServerSpec(config, command, added),
            log_path=logs / f"{label}.log",
            port=port,
            label=label,
            status=f"http://127.0.0.1:{status_port}",
            admin_key=admin_key,
            node=name,
            pool=pool,
            credentials=logs / "credentials",
        )
    command = [
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
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return Server(ServerSpec(config, command, added), log_path=logs / f"{label}.log", port=port, label=label)


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


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, which hold nothing, do not count)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


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


def tail(path: Path, count: int = 25) -> list[str]:
    """The log's last `count` non-blank lines."""
    try:
        return [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-count:]
    except OSError:
        return []


def last_line(path: Path) -> str:
    lines = tail(path, 1)
    return lines[-1] if lines else ""


def error_line(path: Path) -> str:
    """The log's last line that names an error, else its last line: the reason a row shows."""
    lines = tail(path, 200)
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "error:" in line:
            return line.strip()
    return lines[-1].strip() if lines else ""
