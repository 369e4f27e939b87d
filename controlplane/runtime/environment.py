"""The service endpoints of a deployment, read from the environment in one place and validated."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root; in an installed package, the folder that holds the package."""
CHECKOUT = (REPO_ROOT / "manage.py").is_file() and (REPO_ROOT / "frontend" / "templates").is_dir()
"""True when Strata runs from a source checkout, False when from an installed wheel."""

# The longest unix socket path the kernel accepts is 107 bytes; leave room.
_MAX_SOCKET_PATH = 100


class ConfigurationError(ValueError):
    """An environment variable holds a value Strata cannot use; the message names it."""


@dataclasses.dataclass(frozen=True)
class Database:
    """Connection settings for PostgreSQL."""

    name: str
    user: str
    password: str
    host: str
    port: str
    options: dict[str, str]

    def django(self) -> dict[str, Any]:
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": self.name,
            "USER": self.user,
            "PASSWORD": self.password,
            "HOST": self.host,
            "PORT": self.port,
            "CONN_MAX_AGE": 0,
            "OPTIONS": {"connect_timeout": 5, **self.options},
        }


@dataclasses.dataclass(frozen=True)
class RedisEndpoint:
    """A Redis server, by TCP URL or unix socket, with a helper to address each logical db."""

    url: str
    scheme: str  # redis, rediss or unix
    socket_path: str
    db: int
    auth: str = ""
    """A unix URL's `user:password@` (a node's own Redis identity), kept in the URLs made from it."""

    def url_for_db(self, db: int) -> str:
        """redis-py URL of logical database `db` on this server."""
        if self.scheme == "unix":
            return f"unix://{self.auth}{self.socket_path}?db={db}"
        parts = urlsplit(self.url)
        return parts._replace(path=f"/{db}").geturl()

    def celery_url(self, db: int) -> str:
        """kombu broker URL of logical database `db` (kombu spells unix sockets redis+socket://)."""
        if self.scheme == "unix":
            return f"redis+socket://{self.auth}{self.socket_path}?virtual_host={db}"
        return self.url_for_db(db)


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where the deployment's services are, and whether they are the embedded ones."""

    var_dir: Path
    database: Database
    redis: RedisEndpoint
    embedded_postgres: bool
    embedded_redis: bool


def var_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where Strata keeps its state (embedded services, collected static files, checkpoints):
    STRATA_VAR_DIR, else the checkout's var/, else (an installed package, whose folder may not be
    writable) $XDG_STATE_HOME/strata or ~/.local/state/strata."""
    environ = os.environ if environ is None else environ
    if explicit := environ.get("STRATA_VAR_DIR"):
        return Path(explicit).resolve()
    if CHECKOUT:
        return (REPO_ROOT / "var").resolve()
    state = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local" / "state")
    return (Path(state) / "strata").resolve()


def frontend_dirs() -> tuple[Path, Path, Path]:
    """The dashboard's templates, static files and charting library (uPlot): the checkout's
    frontend/ (the library from npm under node_modules), or the copies the wheel carries inside
    controlplane/dashboard/frontend/."""
    if CHECKOUT:
        frontend = REPO_ROOT / "frontend"
        return frontend / "templates", frontend / "static", frontend / "node_modules" / "uplot" / "dist"
    frontend = Path(__file__).resolve().parents[1] / "dashboard" / "frontend"
    return frontend / "templates", frontend / "static", frontend / "vendor" / "uplot"


def socket_dir(var: Path) -> Path:
    """Directory of the embedded services' unix sockets: under var/ unless that path is too long."""
    candidate = var / "run"
    if len(str(candidate / ".s.PGSQL.5432")) <= _MAX_SOCKET_PATH:
        return candidate
    digest = hashlib.sha256(str(var).encode()).hexdigest()[:12]
    return Path("/tmp") / f"strata-{digest}"


def embedded_database_name() -> str:
    return "strata"


def parse_database_url(value: str) -> Database:
    """PostgreSQL settings from postgres://user:pass@host:port/name?opt=v; anything else is refused."""
    text = value.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"DATABASE_URL: not a valid URL ({exc}): {text!r}") from exc
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ConfigurationError(
            f"DATABASE_URL: expected a postgres:// or postgresql:// URL (PostgreSQL only), got {text!r}"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = unquote(parts.hostname or "") if parts.hostname else query.pop("host", "")
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ConfigurationError(f"DATABASE_URL: the URL names no database (…/<name>): {text!r}")
    return Database(
        name=name,
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        host=host,
        port=str(port or ""),
        options=query,
    )


def parse_redis_url(value: str) -> RedisEndpoint:
    """A Redis endpoint from redis://, rediss:// or unix:// URLs; anything else is refused."""
    text = value.strip()
    try:
        parts = urlsplit(text)
        _ = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"REDIS_URL: not a valid URL ({exc}): {text!r}") from exc
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ConfigurationError(
            f"REDIS_URL: expected a redis://host:port/db, rediss:// or unix:///path/to.sock URL, got {text!r}"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigurationError(f"REDIS_URL: a unix:// URL needs a socket path: {text!r}")
        db_text = query.get("db", "0")
        socket_path = parts.path
        auth = parts.netloc if parts.netloc.endswith("@") else ""
    else:
        if not parts.hostname:
            raise ConfigurationError(f"REDIS_URL: the URL names no host: {text!r}")
        db_text = parts.path.lstrip("/") or "0"
        socket_path = ""
        auth = ""
    if not db_text.isdigit():
        raise ConfigurationError(f"REDIS_URL: the database number must be an integer, got {db_text!r}")
    return RedisEndpoint(url=text, scheme=parts.scheme, socket_path=socket_path, db=int(db_text), auth=auth)


def _url_from(environ: Mapping[str, str], name: str) -> str:
    """`name` (DATABASE_URL, REDIS_URL), or the contents of the file `<name>_FILE` names: a node's
    own credential, as `strata_node_credential --url-dir` writes it."""
    url = environ.get(name, "").strip()
    if url_file := environ.get(f"{name}_FILE", "").strip():
        if url:
            raise ConfigurationError(f"{name}_FILE: set beside {name}; set one of them")
        try:
            url = Path(url_file).read_text().strip()
        except OSError as exc:
            raise ConfigurationError(f"{name}_FILE: cannot read {url_file}: {exc.strerror}") from exc
        if not url:
            raise ConfigurationError(f"{name}_FILE: {url_file} is empty")
    return url


def load_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Read DATABASE_URL and REDIS_URL (or DATABASE_URL_FILE and REDIS_URL_FILE, files holding
    them) and STRATA_VAR_DIR; unset URLs mean the embedded services."""
    environ = os.environ if environ is None else environ
    var = var_dir(environ)
    sockets = socket_dir(var)
    database_url = _url_from(environ, "DATABASE_URL")
    redis_url = _url_from(environ, "REDIS_URL")
    if "DATABASE_URL" in environ and not database_url:
        raise ConfigurationError("DATABASE_URL: set but empty; unset it to use the embedded PostgreSQL")
    if "REDIS_URL" in environ and not redis_url:
        raise ConfigurationError("REDIS_URL: set but empty; unset it to use the embedded Redis")
    if database_url:
        database = parse_database_url(database_url)
    else:
        database = Database(
            name=embedded_database_name(),
            user="postgres",
            password="",
            host=str(sockets),
            port="",
            options={},
        )
    if redis_url:
        redis = parse_redis_url(redis_url)
    else:
        path = str(sockets / "redis.sock")
        redis = RedisEndpoint(url=f"unix://{path}", scheme="unix", socket_path=path, db=0)
    return Environment(
        var_dir=var,
        database=database,
        redis=redis,
        embedded_postgres=not database_url,
        embedded_redis=not redis_url,
    )
