"""`make demo`: services, migrations, the admin account, then daphne, two node workers, the control
worker and beat under one supervisor. Ctrl-C or `make stop` ends every process it started."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from controlplane.runtime.embedded import services_start, services_stop
from controlplane.runtime.environment import REPO_ROOT, ConfigurationError, load_environment
from worker.dataplane.directory import ENGINES

NODES = ("gpu-0", "gpu-1")


def _pid_file(var: Path) -> Path:
    return var / "demo.pid"


def _pool_prefix(var: Path) -> str:
    """Shared-memory pools of this demo's nodes are named after its var/ directory."""
    return "strata-" + hashlib.sha256(str(var).encode()).hexdigest()[:8]


def _remove_pools(var: Path) -> list[str]:
    """The nodes' DRAM pools are a cache in /dev/shm; once the demo is down they only hold memory."""
    removed = []
    for pool in sorted(Path("/dev/shm").glob(_pool_prefix(var) + "-*")):
        pool.unlink(missing_ok=True)
        removed.append(pool.name)
    return removed


def node_admin_key(var: Path) -> str:
    """The demo's node admin key, made once and kept in var/node-admin-key (readable by its owner
    only): every demo node requires it on its operator endpoints, and the control plane reads the
    nodes with it."""
    path = var / "node-admin-key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path.read_text().strip()


TENANTS = ("default", "acme", "globex", "rag")
"""The demo's tenant namespaces (rag: the RAG requests)."""


def tenant_credentials(var: Path) -> dict[str, dict[str, str]]:
    """Each demo tenant's API key (the nodes place its requests in its namespace by it) and cache
    salt (its secret: its blocks are keyed with it), made once and kept in var/tenants.json
    (readable by its owner only), where the workload driver reads them."""
    path = var / "tenants.json"
    known: dict[str, dict[str, str]] = {}
    if path.exists():
        known = json.loads(path.read_text())
    if set(known) != set(TENANTS):
        known = {
            name: {"api_key": f"tenant-{secrets.token_urlsafe(24)}", "cache_salt": secrets.token_urlsafe(24)}
            for name in TENANTS
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(json.dumps(known, indent=2))
    return known


def _manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, str(REPO_ROOT / "manage.py"), *args], env=env, check=True, cwd=REPO_ROOT)


VLLM_ARGS = "--max-model-len 8192 --num-gpu-blocks-override 96 --enable-prompt-tokens-details"
"""vLLM nodes of the demo: a KV space of 96 pages (12288 tokens, as a GPU's HBM is small next to
its sessions), so Strata's tiers serve what vLLM's own cache lets go."""


def demo_engines(value: str) -> list[str]:
    """The engine of each demo node from STRATA_DEMO_ENGINE: one name for every node, or one per node."""
    names = [part.strip().lower() for part in value.split(",") if part.strip()] or ["strata"]
    if len(names) == 1:
        names *= len(NODES)
    unknown = sorted(set(names) - set(ENGINES))
    if unknown or len(names) != len(NODES):
        raise ConfigurationError(
            f"STRATA_DEMO_ENGINE: expected strata or vllm, once or once per node ({', '.join(NODES)}), got {value!r}"
        )
    return names


def _procfile(
    port: int,
    model: str,
    first_node_port: int,
    api_port: int,
    engines: list[str] | None = None,
    tenants: Path = Path("var/tenants.json"),
) -> list[tuple[str, str]]:
    python = shlex.quote(sys.executable)
    celery = f"{python} -m celery -A controlplane.celery_app"
    processes = [
        ("web", f"{python} -m daphne -b 127.0.0.1 -p {port} controlplane.asgi:application"),
        (
            "api",
            f"{python} -m gunicorn -c python:controlplane.runtime.gunicorn -b 127.0.0.1:{api_port} "
            "controlplane.wsgi:application",
        ),
    ]
    node_urls = []
    kinds = engines or ["strata"] * len(NODES)
    # The last node Strata's own engine serves reuses fragments (vLLM's connector reuses prefixes
    # only); the workload driver sends it RAG-style requests: shared passages in new orders.
    blending = next((i for i in reversed(range(len(NODES))) if kinds[i] == "strata"), None) if model else None
    for index, name in enumerate(NODES):
        serve = (
            f" --model {shlex.quote(model)} --serve-port {first_node_port + index} --engine {kinds[index]}"
            if model
            else ""
        )
        blend = "STRATA_BLEND=true " if index == blending else ""
        processes.append((name, f"{blend}{python} manage.py strata_node --name {name}{serve}"))
        node_urls.append(f"--node http://127.0.0.1:{first_node_port + index}")
    if blending is not None:
        node_urls.append(f"--rag-node http://127.0.0.1:{first_node_port + blending}")
    if model:
        processes.append(
            ("workload", f"{python} -m worker.workload --tenants {shlex.quote(str(tenants))} {' '.join(node_urls)}")
        )
    processes += [
        (
            "control",
            f"{celery} worker -Q control -n control@%h --pool threads --concurrency 2 "
            "--without-gossip --without-mingle --loglevel WARNING",
        ),
        ("beat", f"{celery} beat --loglevel WARNING --pidfile="),
    ]
    return processes


def _node_credentials(var_dir: Path, env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Each demo node's own database credential, Redis user and admin key (new ones each start),
    as the variables that differ in its environment, by node name: a node reads the directory and
    writes only its own rows, consumes only its own queue, and the control plane reads it with its
    own key (`strata_node_credential`;
    the key stays in var/credentials/NODE.admin.key)."""
    folder = var_dir / "credentials"
    folder.mkdir(mode=0o700, exist_ok=True)
    _manage("strata_node_credential", *NODES, "--url-dir", str(folder), env=env)
    return {
        name: {
            "DATABASE_URL": (folder / f"{name}.url").read_text().strip(),
            "REDIS_URL": (folder / f"{name}.redis.url").read_text().strip(),
            "STRATA_NODE_ADMIN_KEY_FILE": str(folder / f"{name}.admin.key"),
        }
        for name in NODES
    }


def run(port: int, model: str, api_port: int, engines: list[str] | None = None) -> int:
    from honcho.manager import Manager

    env_vars = dict(os.environ)
    env_vars.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.dev")
    env = load_environment(env_vars)
    pid_file = _pid_file(env.var_dir)
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            print(f"the demo is already running (pid {pid_file.read_text().strip()}); `make stop` ends it")
            return 1
        except (OSError, ValueError):
            pid_file.unlink()
    for line in services_start(env):
        print(line)
    metrics_dir = env.var_dir / "prometheus"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    env_vars["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    env_vars["PYTHONUNBUFFERED"] = "1"
    # One shared-memory pool per node of this demo (its var/ directory), not per machine.
    env_vars.setdefault("STRATA_HOST_POOL_NAME", f"{_pool_prefix(env.var_dir)}-{{node}}")
    env_vars.setdefault("STRATA_HOST_BYTES", "512MiB")
    env_vars.setdefault("STRATA_NODE_ADMIN_KEY", node_admin_key(env.var_dir))
    tenants = tenant_credentials(env.var_dir)
    env_vars.setdefault("STRATA_API_KEYS", ",".join(f"{t['api_key']}={name}" for name, t in tenants.items()))
    if "vllm" in (engines or []):
        env_vars.setdefault("STRATA_VLLM_ARGS", VLLM_ARGS)
        env_vars.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _manage("migrate", "--noinput", "-v", "0", env=env_vars)
    _manage("collectstatic", "--noinput", "-v", "0", env=env_vars)
    _manage("strata_admin", env=env_vars)
    _manage("strata_namespace", *TENANTS, env=env_vars)

    pid_file.write_text(str(os.getpid()))
    manager = Manager()
    first_node_port = int(os.environ.get("STRATA_DEMO_NODE_PORT", "9100"))
    credentials = _node_credentials(env.var_dir, env_vars)
    for name, command in _procfile(port, model, first_node_port, api_port, engines, env.var_dir / "tenants.json"):
        process_env = env_vars
        if name in credentials:
            # The node's own key replaces the fleet-wide one, which the control plane keeps for
            # nodes without a credential.
            process_env = {k: v for k, v in env_vars.items() if k != "STRATA_NODE_ADMIN_KEY"} | credentials[name]
        manager.add_process(name, command, env=process_env, cwd=str(REPO_ROOT))
    base = f"http://127.0.0.1:{port}"
    print(
        f"\nStrata is starting:\n"
        f"  dashboard  {base}/            (user admin; password above or in {env.var_dir / 'admin-password'})\n"
        f"  API docs   {base}/api/docs/\n"
        f"  engine API http://127.0.0.1:{api_port}/api/v1/  (the same REST API on a WSGI server, for engines)\n"
        f"  nodes      {base}/api/v1/nodes/\n"
        f"  admin      {base}/admin/\n"
        f"  health     {base}/readyz   metrics {base}/metrics\n"
        + (
            f"  node APIs  http://127.0.0.1:{first_node_port}/v1 and http://127.0.0.1:{first_node_port + 1}/v1"
            f" (OpenAI-compatible, model {model}, engines {', '.join(engines or ['strata'] * len(NODES))}; "
            "a workload driver sends chats and document questions)\n"
            if model
            else ""
        )
        + "Ctrl-C (or `make stop` elsewhere) stops everything.\n",
        flush=True,
    )
    try:
        manager.loop()
    finally:
        pid_file.unlink(missing_ok=True)
    return manager.returncode or 0


def stop() -> int:
    """End a running demo (its supervisor ends its children), then the embedded services."""
    env = load_environment({k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}})
    pid_file = _pid_file(env.var_dir)
    if pid_file.exists():
        try:
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGTERM)
            print(f"stopping the demo (pid {pid})")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
        pid_file.unlink(missing_ok=True)
    for line in services_stop(env):
        print(line)
    removed = _remove_pools(env.var_dir)
    if removed:
        print(f"host-tier pools removed from /dev/shm: {', '.join(removed)}")
    return 0


def _port(name: str, default: str) -> int:
    text = os.environ.get(name, default)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{name}: expected a TCP port number, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.runtime.demo", description=__doc__)
    parser.add_argument("action", choices=["run", "stop"])
    args = parser.parse_args(argv)
    try:
        if args.action == "stop":
            return stop()
        port = _port("STRATA_HTTP_PORT", "8000")
        api_port = _port("STRATA_API_PORT", str(port + 1))
        if api_port == port:
            raise ConfigurationError(f"STRATA_API_PORT: {api_port} is the dashboard's port (STRATA_HTTP_PORT)")
        engines = demo_engines(os.environ.get("STRATA_DEMO_ENGINE", "strata"))
        return run(port, os.environ.get("STRATA_DEMO_MODEL", "bench"), api_port, engines)
    except ConfigurationError as exc:
        print(f"strata: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
