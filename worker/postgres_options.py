"""The node directory client's options and the connection factory it opens its connections with:
timing, sizes, the read replica, and each connection's network options (taken from a node's
config by `DirectoryOptions.from_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import psycopg

from worker.dataplane.config import NodeConfig
from worker.dataplane.network import ConnectionOptions
from worker.postgres_replica import ReplicaOptions

Connect = Callable[[], psycopg.Connection[Any]]


@dataclasses.dataclass(frozen=True)
class DirectoryOptions:
    """Timing and sizes of the directory client."""

    flush_interval_s: float = 0.1
    """Longest a write waits before its batch goes out."""
    batch_size: int = 2000
    """A batch goes out as soon as this many writes wait."""
    capacity: int = 200_000
    """Writes held before the client counts itself over capacity (registrations are still kept)."""
    touch_capacity: int = 100_000
    """Distinct blocks with pending touches; touches of further blocks are dropped."""
    touch_interval_s: float = 2.0
    """How long a block's touches are summed on the node before one update carries them all (a
    flush, or pending touches of half `touch_capacity` blocks, sends them sooner). A block every
    request hits (a shared system prompt) is then updated once per interval per node, not once
    per write batch; the planner reads access counts at minutes' scale."""
    lookup_timeout_ms: int = 250
    """Statement timeout of lookups: past it the engine is better off recomputing."""
    write_timeout_ms: int = 30_000
    """Statement timeout of writes."""
    write_grace_s: float = 5.0
    """A write still without an answer this long after its statement timeout has its connection
    cut (the server's own timeout answers first whenever the server and the path are there)."""
    read_deadline_s: float = 5.0
    """A lookup still without an answer this long after it was sent has its connection cut
    (the node's lookup_deadline_seconds)."""
    connection: ConnectionOptions = ConnectionOptions()
    """Connect timeout, keepalives and TCP user timeout of every connection the client opens."""
    unavailable_s: float = 0.5
    """While the database is unreachable, a probe tries to reach it this often; lookups answer
    DirectoryUnavailable at once until it does."""
    retry_initial_s: float = 0.05
    retry_max_s: float = 2.0
    announce_every_s: float = 1.0
    """Least time between two dashboard events about registered blocks."""
    unknown_grace_s: float = 60.0
    """How long a registration naming a namespace, model or node the directory does not know yet
    is kept and retried (a node's engine may write blocks before its first heartbeat registers
    the node) before it is rejected for good."""
    unknown_retry_s: float = 1.0
    shared_refresh_s: float = 5.0
    """How long the list of shared namespaces is reused before it is read again."""
    replica: ReplicaOptions | None = None
    """A streaming standby that answers lookups and salts within its staleness bound; None: all
    reads go to the primary."""

    def __post_init__(self) -> None:
        for name in (
            "flush_interval_s",
            "unavailable_s",
            "retry_initial_s",
            "retry_max_s",
            "shared_refresh_s",
            "read_deadline_s",
            "write_grace_s",
            "touch_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be greater than zero")
        for name in ("batch_size", "capacity", "touch_capacity", "lookup_timeout_ms", "write_timeout_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")

    @classmethod
    def from_config(cls, config: NodeConfig, **overrides: Any) -> DirectoryOptions:
        """The client of a node: its connections' options, its writes' statement timeout, and
        its lookups cut at the node's lookup deadline."""
        connection = ConnectionOptions.from_config(config)
        fields: dict[str, Any] = {
            "connection": connection,
            "write_timeout_ms": connection.statement_timeout_ms(),
            "read_deadline_s": config.lookup_deadline_seconds,
            "replica": ReplicaOptions.from_config(config),
        }
        return cls(**{**fields, **overrides})

    @property
    def write_deadline_s(self) -> float:
        return self.write_timeout_ms / 1000 + self.write_grace_s


def django_connect(alias: str = "default", *, connection: ConnectionOptions | None = None) -> Connect:
    """A connection factory for the database Django is configured with (the node runs inside
    Django), with `connection`'s connect timeout, keepalives and TCP user timeout."""
    from django.conf import settings

    params = settings.DATABASES[alias]
    options = dict(params.get("OPTIONS") or {})
    options.pop("server_side_binding", None)
    options.pop("pool", None)
    options.pop("isolation_level", None)
    options.pop("assume_role", None)
    options.pop("options", None)  # the client sets its statement timeouts itself
    options.update((connection or ConnectionOptions()).libpq())
    kwargs = {
        "dbname": params["NAME"],
        "user": params.get("USER") or None,
        "password": params.get("PASSWORD") or None,
        "host": params.get("HOST") or None,
        "port": params.get("PORT") or None,
        **options,
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}

    def connect() -> psycopg.Connection[Any]:
        return psycopg.connect(**kwargs)

    return connect
