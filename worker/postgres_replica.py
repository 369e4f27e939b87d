"""The directory client's read replica: reads go to a PostgreSQL streaming standby while its
measured staleness is within a bound, to the primary otherwise.

Staleness is measured, never assumed. Every `probe_s` a thread notes the time t0, reads the
primary's `pg_current_wal_lsn()`, then the replica's `pg_last_wal_replay_lsn()`. Everything the
primary committed before t0 lies at or below that LSN, so once the replica has replayed it, the
replica shows every commit older than t0: its staleness is at most now - t0 for the newest such t0.
A read goes to the replica only while that is within `max_lag_s` (before the first measurement it
is unbounded, so reads start on the primary).

Why a stale answer is safe: a block registered within the bound may be missing (a miss: the engine
recomputes), and a copy the primary has since removed or changed may still be named (the node
reads the copy and verifies its checksum; a copy that is gone or does not match is a miss, never
served). A replica that fails (refused, timed out, cut at its deadline) sends the read to the
primary at once; its reader pool probes it in the background, and reads return to it once it
answers and the measurement shows it caught up.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from controlplane.node_api import DirectoryError
from worker.dataplane.config import NodeConfig
from worker.dataplane.directory import DirectoryUnavailable
from worker.dataplane.network import ConnectionOptions
from worker.postgres_readers import DirectoryReaders

log = logging.getLogger("strata.directory")

LAG = "lag"
FAILURE = "failure"


def lsn_value(text: str) -> int:
    """A pg_lsn's text ('16/B374D848') as a number, for comparing two positions."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """Where the directory's read replica is and how stale its answers may be."""

    url: str
    """libpq URL of a streaming standby of the directory's database."""
    max_lag_s: float = 1.0
    """The most a read served by the replica may lag the primary: a block registered this recently
    may be a miss there (never a wrong hit). Past it reads go to the primary."""
    probe_s: float = 0.2
    """How often the replica's staleness is measured (under max_lag_s, or it would never serve)."""
    connection: ConnectionOptions = ConnectionOptions()
    """Connect timeout, keepalives and TCP user timeout of the replica's connections."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: a replica needs its URL")
        if self.max_lag_s <= 0 or self.probe_s <= 0:
            raise ValueError("max_lag_s, probe_s: must be greater than zero")
        if self.probe_s >= self.max_lag_s:
            raise ValueError("probe_s: must be under max_lag_s (the replica would never serve)")

    @classmethod
    def from_config(cls, config: NodeConfig) -> ReplicaOptions | None:
        """The node's replica (directory_replica_url, directory_replica_max_lag_seconds), if any."""
        if not config.directory_replica_url:
            return None
        lag = config.directory_replica_max_lag_seconds
        return cls(
            url=config.directory_replica_url,
            max_lag_s=lag,
            probe_s=lag / 5,
            connection=ConnectionOptions.from_config(config),
        )

    def connect(self) -> psycopg.Connection[Any]:
        libpq: dict[str, Any] = dict(self.connection.libpq())
        return psycopg.connect(self.url, **libpq)


class ReplicaReads:
    """The replica's reader pool, the thread that measures its staleness, and the choice of where a
    read goes (any thread may read). Its reads share the primary's watchdog and timeouts; a read is
    cut at half the primary's deadline, so a replica that stopped answering leaves the primary
    the other half."""

    def __init__(
        self,
        *,
        options: ReplicaOptions,
        open_connection: Callable[[], psycopg.Connection[Any]],
        primary: DirectoryReaders,
        count: Callable[[str], None],
    ) -> None:
        self.max_lag_s = options.max_lag_s
        self.probe_s = options.probe_s
        self._primary = primary
        self._count = count
        self.readers = DirectoryReaders(
            open_connection=open_connection,
            watchdog=primary.watchdog,
            deadline_s=primary.deadline_s / 2,
            statement_ms=primary.statement_ms,
            retry_s=primary.retry_s,
            count=lambda name: count("replica_" + name),
            down_note="directory read replica unreachable: a probe reconnects in the background",
            up_note="directory read replica answers again: reads return to it once it has caught up",
        )
        self._lock = threading.Condition()
        self._closed = False
        self._caught_up_at: float | None = None  # the newest t0 the replica has replayed past
        self._pending: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)
        self._on_replica = False
        self._not_standby_said = False
        self._thread = threading.Thread(target=self._measuring, name="strata-directory-replica", daemon=True)
        self._thread.start()

    def read(self, query: Callable[[psycopg.Cursor[Any]], Any]) -> Any:
        """`query` on the replica when it may serve it, else (or when it fails) on the primary;
        counted by where it went and why."""
        reason = self.unusable()
        detail = ""
        if reason is None:
            try:
                answer = self.readers.read(query)
            except DirectoryUnavailable as exc:
                reason, detail = FAILURE, str(exc)
            except DirectoryError:
                # Something the replica does not know yet (a namespace created a moment ago):
                # the primary answers for good.
                pass
            else:
                self._count("replica_reads")
                self._served()
                return answer
        if reason is not None:
            self._count(f"replica_{reason}_fallbacks")
            self._passed_over(reason, detail)
        answer = self._primary.read(query)
        self._count("primary_reads")
        return answer

    def staleness_s(self) -> float:
        """How far behind the primary the replica may be, at most, as last measured (inf before
        the first measurement)."""
        with self._lock:
            caught = self._caught_up_at
        return math.inf if caught is None else max(time.monotonic() - caught, 0.0)

    def unusable(self) -> str | None:
        """Why a read must go to the primary now (LAG or FAILURE), None when the replica may serve it."""
        if self.readers.down:
            return FAILURE
        if self.staleness_s() > self.max_lag_s:
            return LAG
        return None

    def _served(self) -> None:
        """A read was answered by the replica."""
        if not self._on_replica:
            with self._lock:
                if self._on_replica:
                    return
                self._on_replica = True
            log.info(
                "directory reads go to the read replica (measured staleness %.2f s, bound %g s)",
                self.staleness_s(),
                self.max_lag_s,
            )

    def _passed_over(self, reason: str, detail: str) -> None:
        """A read went to the primary instead, for `reason`."""
        if self._on_replica:
            with self._lock:
                if not self._on_replica:
                    return
                self._on_replica = False
            if reason == LAG:
                log.warning(
                    "directory reads go to the primary: the read replica may be %.2f s behind, over the bound of %g s",
                    self.staleness_s(),
                    self.max_lag_s,
                )
            else:
                log.warning("directory reads go to the primary: the read replica failed (%s)", detail or "unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=5)
        self.readers.close()

    # -- the measuring thread --------------------------------------------------------------------
    def _measuring(self) -> None:
        while True:
            with self._lock:
                self._lock.wait(self.probe_s)
                if self._closed:
                    return
            try:
                self._measure()
            except Exception as exc:  # noqa: BLE001 - a failed measurement leaves the last one aging
                log.warning("could not measure the read replica's staleness: %s", exc)

    def _measure(self) -> None:
        if self._primary.down:
            return  # nothing to measure against; the last measurement ages
        t0 = time.monotonic()
        try:
            written = self._primary.read(lambda cur: cur.execute("SELECT pg_current_wal_lsn()::text").fetchone())
        except DirectoryUnavailable:
            return  # the primary is down: nothing to measure against; the last measurement ages
        with self._lock:
            self._pending.append((t0, lsn_value(written[0])))
        if self.readers.down:
            return  # the replica's own probe is reconnecting
        try:
            row = self.readers.read(
                lambda cur: cur.execute("SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text").fetchone()
            )
        except DirectoryUnavailable:
            return
        in_recovery, replayed = row
        if not in_recovery or replayed is None:
            # A server that is not replaying the primary's WAL (a promoted standby, another
            # primary): no measurement bounds its staleness, so it never serves.
            if not self._not_standby_said:
                self._not_standby_said = True
                log.warning("the directory read replica is not a streaming standby: reads stay on the primary")
            return
        position = lsn_value(replayed)
        with self._lock:
            while self._pending and self._pending[0][1] <= position:
                at, _ = self._pending.popleft()
                self._caught_up_at = at if self._caught_up_at is None else max(self._caught_up_at, at)
