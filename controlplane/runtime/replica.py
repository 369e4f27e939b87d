"""A streaming read replica (hot standby) of a PostgreSQL primary on this machine, on its own socket.

    with streaming_standby(EmbeddedPostgres(env)) as standby:
        psycopg.connect(standby.url(dbname))   # reads; pg_is_in_recovery() is true
        standby.stop(immediate=True)           # a crash; standby.start() brings it back

The standby is a copy taken with `pg_basebackup -R -X stream` (the primary's WAL streamed during
the copy, `standby.signal` and `primary_conninfo` written), started with `pg_ctl` on a unix socket
in its own directory (no TCP), as the embedded server's system user when we are root. It replays
what the primary writes from then on; a restart resumes streaming where replay stopped.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg

from controlplane.runtime.embedded import (
    EmbeddedPostgres,
    _chown,
    _ensure_traversable,
    _pg_bin,
    _private_socket_dir,
    _run_as,
    _system_user,
)

# A hot standby refuses to start with less of these than its primary has.
_MATCH_PRIMARY = (
    "max_connections",
    "max_worker_processes",
    "max_wal_senders",
    "max_prepared_transactions",
    "max_locks_per_transaction",
)


class StreamingStandby:
    """A hot standby of the primary reached with `primary` (libpq keywords: host, port, user; the
    user may connect for replication), data and socket under `root`, started with `settings`
    (server settings by name, e.g. the embedded server's `server_settings` for a benchmark)."""

    def __init__(
        self, *, primary: dict[str, Any], root: Path, port: int = 5432, settings: Mapping[str, str] | None = None
    ) -> None:
        self.primary = dict(primary)
        self.settings = dict(settings or {})
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sockets"
        self.log = root / "standby.log"
        self.port = port
        self._user = _system_user()

    def conninfo(self, dbname: str) -> dict[str, Any]:
        """psycopg keyword arguments of a connection to the standby, as the primary's user."""
        return {"host": str(self.sockets), "port": self.port, "dbname": dbname, "user": self.primary["user"]}

    def url(self, dbname: str) -> str:
        """The same as a postgresql:// URL (a node's STRATA_DIRECTORY_REPLICA_URL)."""
        query = urllib.parse.urlencode({"host": str(self.sockets), "port": self.port})
        return f"postgresql://{urllib.parse.quote(self.primary['user'])}@/{urllib.parse.quote(dbname)}?{query}"

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._pg_ctl("status").returncode == 0

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Copy the primary (first start only), start the standby, and return once it answers
        reads."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if self._user:
            _ensure_traversable(self.root)
            _chown(self.root, self._user)
        _private_socket_dir(self.sockets, self._user)
        if not (self.data / "PG_VERSION").exists():
            self._copy_primary()
        chosen = {"shared_buffers": "128MB", **self.settings, **self._primary_settings()}
        settings = " ".join(f"-c {name}={value}" for name, value in chosen.items())
        result = self._pg_ctl(
            "-w",
            "-t",
            str(int(timeout_s)),
            "-l",
            str(self.log),
            "-o",
            f"-p {self.port} -c listen_addresses='' -k {self.sockets} -c unix_socket_permissions=0770 "
            f"-c hot_standby=on {settings}",
            "start",
        )
        if result.returncode != 0:
            raise RuntimeError(f"the standby did not start: {result.stderr.strip()}\n{self._log_tail()}")
        self._wait_for_reads(timeout_s)

    def stop(self, *, immediate: bool = False) -> None:
        """Stop the standby: a clean shutdown, or (`immediate`) the way a crash stops it."""
        if not self.running():
            return
        result = self._pg_ctl("-w", "-t", "60", "-m", "immediate" if immediate else "fast", "stop")
        if result.returncode != 0:
            raise RuntimeError(f"the standby did not stop: {result.stderr.strip()}")

    # -- inside ----------------------------------------------------------------------------------
    def _pg_ctl(self, *args: str) -> Any:
        # pg_ctl refuses to run as root, even for status.
        return _run_as([_pg_bin("pg_ctl"), "-D", str(self.data), *args], self._user)

    def _copy_primary(self) -> None:
        if self.data.exists():
            shutil.rmtree(self.data)
        result = _run_as(
            [
                _pg_bin("pg_basebackup"),
                "-h",
                str(self.primary["host"]),
                "-p",
                str(self.primary.get("port", 5432)),
                "-U",
                str(self.primary["user"]),
                "-D",
                str(self.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
                "-w",
            ],
            self._user,
        )
        if result.returncode != 0:
            raise RuntimeError(f"pg_basebackup of the primary failed: {result.stderr.strip()}")

    def _primary_settings(self) -> dict[str, str]:
        with psycopg.connect(**self.primary, dbname="postgres", connect_timeout=5) as conn:
            rows = conn.execute("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(_MATCH_PRIMARY),))
            return dict(rows.fetchall())

    def _wait_for_reads(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(**self.conninfo("postgres"), connect_timeout=2) as conn:
                    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row and row[0]:
                    return
                raise RuntimeError("the standby answers but is not in recovery (promoted?)")
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby does not answer reads: {exc}\n{self._log_tail()}") from exc
                time.sleep(0.05)

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""


@contextlib.contextmanager
def streaming_standby(
    primary: EmbeddedPostgres, *, root: Path | None = None, settings: Mapping[str, str] | None = None
) -> Iterator[StreamingStandby]:
    """A started standby of an embedded server (its private socket, its `postgres` user); stopped,
    and its files removed when `root` was not given, on the way out."""
    own = root is None
    where = Path(tempfile.mkdtemp(prefix="strata-standby-")) if root is None else root
    standby = StreamingStandby(
        primary={"host": str(primary.sockets), "user": "postgres"}, root=where, settings=settings
    )
    try:
        standby.start()
        yield standby
    finally:
        try:
            standby.stop(immediate=True)
        finally:
            if own:
                shutil.rmtree(where, ignore_errors=True)
