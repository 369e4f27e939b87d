"""The node runtime: a Celery worker on queue node.<name> and the heartbeat that reports its tiers.

Imports inside functions here are deliberate: the model engine (torch, transformers) and the vLLM
server load only in a node that serves that engine, and the control-plane services only once the
worker has set Django up. Every read and write of the control plane's data goes through
`controlplane.node_api`."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

from celery import Celery, bootsteps

from worker.dataplane import native
from worker.dataplane.config import NodeConfig
from worker.dataplane.tier_names import DEVICE, DISK, HOST, REMOTE

log = logging.getLogger("strata.node")

VERSION = "0.1.0"


def _dir_bytes(path: Path) -> int:
    total = 0
    if path.exists():
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


class NodeRuntime:
    """What a node knows about itself: its options, its engine (when it serves a model) and the
    current use of its tiers."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        native.use(config.native_copy)  # before any tier copies or hashes
        self.host = socket.gethostname()
        self.store: Any = None
        self.engine: Any = None
        self.server: Any = None
        self.directory: Any = None
        self.vllm: Any = None
        self.status_address = ""
        """host:port of a vLLM node's Strata endpoints (the connector's status server)."""
        self.policy_version = 0
        self.policy_classes: list[Any] = []
        self.policy_tiers: list[dict[str, Any]] = []
        self.policy_quotas: list[dict[str, Any]] = []
        self._policy_lock = threading.Lock()

    def start_engine(self) -> None:
        """Load the model, open the node's tiers and the directory, and serve the OpenAI API (with
        engine vllm: open the tiers and start vLLM, which loads the model and serves)."""
        config = self.config
        if not config.model:
            return
        if config.engine == "vllm":
            self._start_vllm()
            return
        from controlplane.node_api import modelprofile_ensure, namespace_ensure
        from worker.dataplane.blend.options import BlendOptions
        from worker.dataplane.engine.engine import Engine, EngineOptions
        from worker.dataplane.models.loading import load_model
        from worker.dataplane.serving.server import NodeServer
        from worker.dataplane.store import build_store
        from worker.postgres_directory import DirectoryOptions, PostgresDirectory

        model = load_model(config.model, dtype=config.model_dtype or None, cache_dir=config.cache_dir)
        profile = model.profile(config.block_tokens)
        modelprofile_ensure(profile=profile)
        namespace_ensure(name=config.default_namespace)
        for namespace in set(config.api_keys.values()):
            namespace_ensure(name=namespace)
        self.store = build_store(config, profile=profile, environ=self._tier_environ())
        self.directory = PostgresDirectory(options=DirectoryOptions.from_config(config))
        self.engine = Engine(
            model=model,
            store=self.store,
            node=config.node_name,
            directory=self.directory,
            options=EngineOptions(
                block_tokens=config.block_tokens,
                write_back_tier=HOST if HOST in self.store.names else self.store.names[-1],
                blend=BlendOptions.from_config(config),
                lookup_deadline_s=config.lookup_deadline_seconds,
                load_deadline_s=config.load_deadline_seconds,
            ),
        )
        # The device shares of the policies in force, before the first request.
        try:
            self.policies_refresh()
        except Exception as exc:  # noqa: BLE001 - serve anyway; the heartbeat reads them again
            log.warning("could not read the policies in force at start: %s", exc)
        self.server = NodeServer(
            engine=self.engine,
            host=config.serve_host,
            port=config.serve_port,
            node=config.node_name,
            api_keys=config.api_keys,
            admin_key=config.node_admin_key,
            namespace_header=config.namespace_header,
            client_namespaces=config.client_namespaces,
            default_namespace=config.default_namespace,
        ).start()

    def _start_vllm(self) -> None:
        """The node of a vLLM engine: the model's profile from its checkpoint (vLLM loads the
        weights), the node's tiers for its worker's movements and its heartbeat, and, unless
        vllm_launch is off, the vLLM server itself."""
        from controlplane.node_api import modelprofile_ensure, namespace_ensure
        from worker.dataplane.models.loading import checkpoint_profile
        from worker.dataplane.store import build_store
        from worker.vllm_server import VllmServer

        config = self.config
        checkpoint = self.checkpoint()
        kept = config.cache_dir
        dtype = (
            config.model_dtype or checkpoint_profile(checkpoint, block_tokens=config.block_tokens, cache_dir=kept).dtype
        )
        profile = checkpoint_profile(checkpoint, dtype=dtype, block_tokens=config.block_tokens, cache_dir=kept)
        modelprofile_ensure(profile=profile)
        namespace_ensure(name=config.default_namespace)
        for namespace in set(config.api_keys.values()):
            namespace_ensure(name=namespace)
        tiers = [name for name in config.tiers if name != DEVICE]  # vLLM's own pages are L1
        below = dataclasses.replace(config, tiers=type(config.tiers)(tiers))
        self.store = build_store(below, profile=profile, environ=self._tier_environ())
        self.status_address = f"{config.serve_host}:{config.node_status_port}"
        if config.vllm_launch:
            self.vllm = VllmServer(config, model=str(checkpoint), dtype=dtype).start()
        else:
            log.info(
                "node %s: serving through a vLLM server started elsewhere (its Strata endpoints at %s)",
                config.node_name,
                self.status_address,
            )

    def checkpoint(self) -> Path:
        """The checkpoint directory vLLM loads: the model option's (a directory, or a hub id's
        snapshot in the local hub cache), or for a preset, the preset saved once under
        {var}/checkpoints/<preset> (random weights and the byte tokenizer)."""
        from worker.dataplane.models.loading import PRESETS, preset_checkpoint, resolve_checkpoint

        spec = self.config.model
        if spec not in PRESETS:
            return resolve_checkpoint(spec).path
        return preset_checkpoint(spec, Path(os.environ.get("STRATA_VAR_DIR") or "var") / "checkpoints")

    def _tier_environ(self) -> dict[str, str]:
        from django.conf import settings

        # With no STRATA_REMOTE_URL, L3 lives in the deployment's Redis (its own logical database).
        return {**os.environ, "REDIS_URL": settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)}

    def apply_policies(
        self,
        *,
        version: int,
        classes: list[dict[str, Any]],
        tiers: list[dict[str, Any]] | None = None,
        quotas: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Hold the engine to policy `version`: its device working set to the classes' shares and
        the device tier's rule, its host and disk write-back to their tiers' eviction rules and
        the namespaces' quotas (`Engine.apply_policies`), and its write-back's copies to L3 to the
        classes that write through. An older version than the one in force is ignored (messages
        may arrive late or twice)."""
        from worker.dataplane.engine.working_set import ClassShare
        from worker.dataplane.eviction.rules import parse_rules
        from worker.dataplane.remote_write import RemoteWritePolicy

        shares = [ClassShare.from_dict(item) for item in classes]  # a bad payload raises, naming the field
        RemoteWritePolicy.from_classes(classes)  # likewise, before any is kept
        tiers, quotas = list(tiers or []), list(quotas or [])
        group = self.config.node_group
        parse_rules(tiers=tiers, classes=classes, quotas=quotas, node_group=group)  # likewise, before any is kept
        with self._policy_lock:
            if version < self.policy_version:
                log.info("policy version %d ignored: version %d is already in force", version, self.policy_version)
                return False
            self.policy_version = version
            self.policy_classes = shares
            self.policy_tiers = tiers
            self.policy_quotas = quotas
            if self.engine is not None:
                self.engine.apply_policies(
                    version=version, classes=classes, tiers=tiers, quotas=quotas, node_group=group
                )
        return True

    def policies_refresh(self) -> None:
        """Read the policies in force and apply them if they changed (at start, and at each
        heartbeat, so a node that missed a message catches up within one interval)."""
        from controlplane.node_api import policies_in_force

        version, policies = policies_in_force()
        if version != self.policy_version:
            self.apply_policies(version=version, **policies)

    def policies_announced(self, *, version: int) -> None:
        """A `node.apply_policies` message for `version`: apply what the directory holds. A
        version the directory does not hold (a message forged, or from a rolled-back change) is
        logged and counted, and changes nothing beyond what the directory says."""
        from controlplane.node_api import policies_in_force

        in_force, policies = policies_in_force()
        if version != in_force:
            log.warning(
                "policy message for version %r refused: the directory's version in force is %d (applied instead)",
                version,
                in_force,
            )
        if in_force != self.policy_version:
            self.apply_policies(version=in_force, **policies)

    def stop_engine(self) -> None:
        if self.vllm is not None:
            self.vllm.stop()
        if self.server is not None:
            self.server.stop()
        if self.engine is not None:
            self.engine.close()
        if self.directory is not None:
            self.directory.close()
        if self.store is not None:
            self.store.close()

    @property
    def address(self) -> str:
        if self.server is not None:
            return self.config.node_address or self.server.address
        return self.config.node_address or self.status_address

    @property
    def engine_address(self) -> str:
        """host:port of vLLM's own server (its OpenAI API and /metrics) on a vLLM node."""
        if not (self.config.model and self.config.engine == "vllm"):
            return ""
        # Where the node is reached (its address's host), else where vLLM listens.
        host = self.config.node_address.rpartition(":")[0] or self.config.serve_host
        return f"{host}:{self.config.serve_port}"

    def prepare(self) -> None:
        """Create the node's local tier directories; fail loudly if they cannot exist."""
        disk = self.config.node_disk_path
        disk.mkdir(parents=True, exist_ok=True)
        if not os.access(disk, os.W_OK):
            raise PermissionError(f"disk tier directory {disk} is not writable")
        free = shutil.disk_usage(disk).free + _dir_bytes(disk)
        if free < self.config.disk_bytes:
            log.warning(
                "disk tier %s: capacity %d bytes configured but only %d bytes free on its filesystem",
                disk,
                self.config.disk_bytes,
                free,
            )

    def tier_reports(self) -> list[dict[str, Any]]:
        """Capacity and use per tier, as plain data for the heartbeat service."""
        if self.store is not None:
            reports = []
            for name, usage in self.store.usage().items():
                reports.append({"tier": name, "capacity_bytes": usage.capacity_bytes, "used_bytes": usage.used_bytes})
            return reports
        c = self.config
        return [
            {"tier": DEVICE, "capacity_bytes": c.device_bytes, "used_bytes": 0},
            {"tier": HOST, "capacity_bytes": c.host_bytes, "used_bytes": 0},
            {
                "tier": DISK,
                "capacity_bytes": c.disk_bytes,
                "used_bytes": min(_dir_bytes(c.node_disk_path), c.disk_bytes) if c.disk_bytes else 0,
            },
            {"tier": REMOTE, "capacity_bytes": c.remote_bytes, "used_bytes": 0},
        ]

    def heartbeat(self) -> None:
        """Report this node to the directory (one transaction)."""
        from controlplane.node_api import TierReport, node_heartbeat

        node_heartbeat(
            name=self.config.node_name,
            host=self.host,
            address=self.address,
            pid=os.getpid(),
            version=VERSION,
            heartbeat_seconds=self.config.heartbeat_seconds,
            tiers=[TierReport(**report) for report in self.tier_reports()],
            group=self.config.node_group,
            engine=self.config.engine if self.config.model else "strata",
            engine_address=self.engine_address,
            traffic=self.engine.traffic.summary() if getattr(self.engine, "traffic", None) is not None else None,
        )

    def shutdown(self) -> None:
        from controlplane.node_api import node_mark_down

        node_mark_down(name=self.config.node_name)


class HeartbeatStep(bootsteps.StartStopStep):
    """Runs the heartbeat inside the worker: a node is `up` only while its worker is."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.runtime: NodeRuntime = parent.app.strata_runtime
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _loop(self) -> None:
        from django.db import close_old_connections

        failures = 0
        while not self.stop_event.is_set():
            try:
                close_old_connections()
                self.runtime.heartbeat()
                try:
                    self.runtime.policies_refresh()
                except Exception as exc:  # noqa: BLE001 - the shares in force stay until the next beat
                    log.warning("could not read the policies in force: %s", exc)
                if failures:
                    log.info("heartbeat delivered again after %d failure(s)", failures)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a failed beat is retried at the next interval
                failures += 1
                if failures == 1 or failures % 12 == 0:
                    log.warning("heartbeat failed (%d in a row): %s", failures, exc)
            self.stop_event.wait(self.runtime.config.heartbeat_seconds)

    def start(self, parent: Any) -> None:
        name = self.runtime.config.node_name
        log.info("node %s: heartbeat every %.1fs on queue node.%s", name, self.runtime.config.heartbeat_seconds, name)
        self.thread = threading.Thread(target=self._loop, name=f"heartbeat-{name}", daemon=True)
        self.thread.start()

    def stop(self, parent: Any) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
            self.thread = None
            try:
                from django.db import close_old_connections

                close_old_connections()
                self.runtime.shutdown()
                log.info("node %s: marked down", self.runtime.config.node_name)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway; the stale sweep will notice
                log.warning("could not mark the node down: %s", exc)


def run_node(app: Celery, config: NodeConfig, *, loglevel: str = "INFO") -> int:
    """Start the node's Celery worker in this process and block until it stops."""
    from controlplane.node_api import node_broker_transport_options
    from controlplane.runtime.redis_check import refuse_evicting_redis
    from worker.connections import broker_options_apply

    refuse_evicting_redis(f"node {config.node_name}")
    broker_options_apply(app, config)
    runtime = NodeRuntime(config)
    runtime.prepare()
    try:
        runtime.start_engine()
    except ValueError as exc:  # a bad model, dtype or tier option: say which, then stop
        runtime.stop_engine()
        raise SystemExit(f"strata_node: {exc}") from None
    app.strata_runtime = runtime  # type: ignore[attr-defined]
    app.steps["worker"].add(HeartbeatStep)
    queue = f"node.{config.node_name}"
    # The node's own Redis user may touch only its queue's keys: its unacknowledged messages are
    # kept under them. Remote control stays on: without its pidbox consumer, a worker on the Redis
    # transport does not notice that a restarted broker dropped its connection, and stops consuming.
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        **node_broker_transport_options(config.node_name),
    }
    log.info(
        "node %s starting: queue %s, device %d B, host %d B, disk %d B at %s, remote %d B",
        config.node_name,
        queue,
        config.device_bytes,
        config.host_bytes,
        config.disk_bytes,
        config.node_disk_path,
        config.remote_bytes,
    )
    worker = app.Worker(
        hostname=f"{config.node_name}@{runtime.host}",
        queues=[queue],
        pool="threads",
        concurrency=config.worker_concurrency,
        loglevel=loglevel,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
    )
    try:
        worker.start()
    finally:
        runtime.stop_engine()
    return int(worker.exitcode or 0)
