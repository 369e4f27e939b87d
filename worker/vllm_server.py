"""A vLLM OpenAI server with Strata as its KV connector, started and stopped by a node (`--engine vllm`).

    python -m vllm.entrypoints.openai.api_server --model DIR --host H --port P --dtype D
        --kv-transfer-config '{"kv_connector": "StrataConnector", ...}' [vllm_args]

The server inherits the node's environment and options (as STRATA_* variables, so the connector
opens the same host pool, disk directory and remote tier as the node's worker), and serves
its Strata endpoints on the node's status port. If it exits while the node runs, the node stops
too: a node without its engine would report tiers nobody serves from.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

from worker.dataplane.config import NodeConfig

log = logging.getLogger("strata.node")

CONNECTOR_OPTIONS = (
    "node_name",
    "tiers",
    "host_bytes",
    "host_pool_name",
    "disk_bytes",
    "disk_direct_io",
    "disk_io_threads",
    "disk_reuse_seconds",
    "remote_bytes",
    "remote_url",
    "remote_prefix",
    "remote_cluster",
    "remote_timeout_seconds",
    "io_threads",
    "copy_threads",
    "block_tokens",
    "serve_host",
    "namespace_header",
    "client_namespaces",
    "default_namespace",
)
"""The node options the connector inside vLLM reads (handed over as STRATA_* variables; the
tenants' API keys and the namespace secret are handed over by `server_environ` too)."""

NAMESPACE_MIDDLEWARE = "worker.dataplane.connectors.vllm.tenancy.NamespaceMiddleware"
"""vLLM's API server middleware that places requests in namespaces by API key or trusted header."""


def places_by_identity(config: NodeConfig) -> bool:
    """Whether the vLLM server needs NamespaceMiddleware (API keys or a trusted header)."""
    return bool(config.api_keys or config.namespace_header)


def plugin_installed() -> bool:
    """Whether vLLM finds StrataConnector by name: this package's `vllm.general_plugins` entry
    point is installed (an install of the package, editable or not, puts it there)."""
    from importlib.metadata import entry_points

    return any(e.value == "worker.vllm_plugin:register" for e in entry_points(group="vllm.general_plugins"))


def kv_transfer_config(config: NodeConfig) -> dict[str, object]:
    """vLLM's --kv-transfer-config for this node: the connector by name, as an operator writes it,
    or by module path where the package's entry point is not installed (a tree run uninstalled)."""
    located = {} if plugin_installed() else {"kv_connector_module_path": "worker.vllm_connector"}
    return {
        "kv_connector": "StrataConnector",
        **located,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node_name": config.node_name, "status_port": config.node_status_port},
    }


def server_command(config: NodeConfig, *, model: str, dtype: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        config.serve_host,
        "--port",
        str(config.serve_port),
        "--dtype",
        dtype,
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(config)),
        *(["--middleware", NAMESPACE_MIDDLEWARE] if places_by_identity(config) else []),
        *config.vllm_args,
    ]


def server_environ(config: NodeConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The node's environment plus its options (flags included) as the connector reads them."""
    options = {f"STRATA_{name.upper()}": str(getattr(config, name)) for name in CONNECTOR_OPTIONS}
    options["STRATA_DISK_PATH"] = str(config.node_disk_path.resolve())
    options["STRATA_API_KEYS"] = ",".join(f"{key}={namespace}" for key, namespace in config.api_keys.items())
    # The middleware vouches for the namespaces it places with this secret, and the connector in
    # vLLM's engine checks it: one made for this server unless the operator gave one.
    secret = config.namespace_secret or (secrets.token_urlsafe(32) if places_by_identity(config) else "")
    options["STRATA_NAMESPACE_SECRET"] = secret
    return {**environ, **options}


class VllmServer:
    """One vLLM server process of a node."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        model: str,
        dtype: str,
        environ: Mapping[str, str] | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.command = server_command(config, model=model, dtype=dtype)
        self.environ = server_environ(config, os.environ if environ is None else environ)
        self.on_exit = on_exit if on_exit is not None else _stop_node
        self.process: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._watcher: threading.Thread | None = None

    def start(self) -> VllmServer:
        log.info(
            "node %s: starting vLLM on %s:%d for %s (Strata endpoints on port %d)",
            self.config.node_name,
            self.config.serve_host,
            self.config.serve_port,
            self.command[self.command.index("--model") + 1],
            self.config.node_status_port,
        )
        # Its own process group: a signal to the node does not reach vLLM's processes before the
        # node has stopped them in order.
        self.process = subprocess.Popen(self.command, env=self.environ, start_new_session=True)
        self._watcher = threading.Thread(target=self._watch, name="vllm-watch", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        assert self.process is not None
        code = self.process.wait()
        if not self._stopping:
            log.error("node %s: the vLLM server exited (code %d); stopping the node", self.config.node_name, code)
            self.on_exit(code)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("node %s: vLLM did not stop within %.0fs; killing it", self.config.node_name, timeout)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _stop_node(_code: int) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
