"""The directory client's reader connections: a pool, a deadline on every read, and a probe that
reconnects in the background while the database cannot be reached.

A read takes an idle connection (or opens one), runs under the watchdog's deadline and hands the
connection back. Past its deadline the read's socket is cut (`network.Watchdog`): a path that
drops packets, or a server that stopped answering, costs one read its deadline, not TCP's 15
minutes. From a read that found the database unreachable until a probe connects again, every
read answers DirectoryUnavailable at once (engines recompute meanwhile), and only the probe
thread waits on the network, once every `retry_s`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors

from worker.dataplane.directory import DirectoryUnavailable
from worker.dataplane.network import Watchdog

log = logging.getLogger("strata.directory")

TRANSIENT = (psycopg.OperationalError, psycopg.InterfaceError)
"""Errors after which the same statement may succeed later (connection lost, server restarting,
timeouts, deadlocks, serialization failures); anything else is a property of the data."""


class DirectoryReaders:
    """Reader connections shared by the threads that look up (any thread may read)."""

    def __init__(
        self,
        *,
        open_connection: Callable[[], psycopg.Connection[Any]],
        watchdog: Watchdog,
        deadline_s: float,
        statement_ms: int,
        retry_s: float,
        count: Callable[[str], None],
        down_note: str = "directory database unreachable: lookups are misses until it answers again",
        up_note: str = "directory database answers again: lookups go to it",
    ) -> None:
        self._open = open_connection
        self._down_note = down_note
        self._up_note = up_note
        self.watchdog = watchdog
        self.deadline_s = deadline_s
        self.statement_ms = statement_ms
        self.retry_s = retry_s
        self._count = count
        self._lock = threading.Condition()
        self._idle: list[psycopg.Connection[Any]] = []
        self._open_conns: set[psycopg.Connection[Any]] = set()
        self._down = False
        self._probe: threading.Thread | None = None
        self._closed = False

    @property
    def down(self) -> bool:
        """True from a read that found the database unreachable until the probe reconnects."""
        return self._down

    def read(self, query: Callable[[psycopg.Cursor[Any]], Any]) -> Any:
        """`query` run on a reader connection; DirectoryUnavailable when the database cannot
        answer within the statement timeout or the deadline, or cannot be reached."""
        if self._down:
            self._count("lookup_failures")
            raise DirectoryUnavailable("the directory database was unreachable a moment ago")
        for attempt in (1, 2):
            conn, fresh = self._take()
            token = self.watchdog.arm(conn.fileno(), self.deadline_s, what="a directory lookup")
            try:
                with conn.cursor() as cur:
                    answer = query(cur)
            except TRANSIENT as exc:
                in_time = self.watchdog.disarm(token)
                if in_time and isinstance(exc, psycopg.errors.QueryCanceled):
                    # The server's statement timeout: the connection itself is fine.
                    self._give_back(conn)
                    self._count("lookup_failures")
                    raise DirectoryUnavailable(f"lookup took over {self.statement_ms} ms") from exc
                self._discard(conn)
                if not in_time:
                    self._count("read_deadlines")
                    self._mark_down()
                    raise DirectoryUnavailable(
                        f"no answer from the directory database within {self.deadline_s:g} s"
                    ) from exc
                # A connection that served before may just be stale (the server restarted):
                # one fresh attempt, then give up quickly.
                if fresh or attempt == 2:
                    self._mark_down()
                    raise DirectoryUnavailable(f"directory database unreachable: {exc}") from exc
                continue
            except BaseException:
                if self.watchdog.disarm(token):
                    self._give_back(conn)  # an error of the query's own (an unknown namespace)
                else:
                    self._discard(conn)
                raise
            if self.watchdog.disarm(token):
                self._give_back(conn)
            else:
                self._discard(conn)  # cut just as the answer came: the connection is gone
            return answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = list(self._open_conns), []
            self._open_conns.clear()
            self._lock.notify_all()
            probe = self._probe
        for conn in conns:
            conn.close()
        if probe is not None:
            probe.join(timeout=5)

    # -- connections ---------------------------------------------------------------------------
    def _take(self) -> tuple[psycopg.Connection[Any], bool]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn, False
                self._open_conns.discard(conn)
        try:
            conn = self._open()
        except TRANSIENT as exc:
            self._mark_down()
            raise DirectoryUnavailable(f"directory database unreachable: {exc}") from exc
        with self._lock:
            self._open_conns.add(conn)
        return conn, True

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if not self._closed and not conn.closed:
                self._idle.append(conn)
                return
            self._open_conns.discard(conn)
        conn.close()

    def _discard(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._open_conns.discard(conn)
        conn.close()

    # -- while the database is unreachable ------------------------------------------------------
    def _mark_down(self) -> None:
        self._count("lookup_failures")
        with self._lock:
            if self._closed:
                return
            if not self._down:
                log.warning(self._down_note)
            self._down = True
            # The idle connections share the path that failed: a probe opens a fresh one.
            stale, self._idle = self._idle, []
            for conn in stale:
                self._open_conns.discard(conn)
            if self._probe is None or not self._probe.is_alive():
                self._probe = threading.Thread(target=self._probing, name="strata-directory-probe", daemon=True)
                self._probe.start()
        for conn in stale:
            conn.close()

    def _probing(self) -> None:
        """Every `retry_s`, open a connection and ask the database a trivial question within the
        deadline; on an answer, lend the connection to the readers and let reads through."""
        while True:
            with self._lock:
                if self._closed:
                    return
                self._lock.wait(self.retry_s)
                if self._closed:
                    return
            try:
                conn = self._open()
            except TRANSIENT:
                continue
            token = self.watchdog.arm(conn.fileno(), self.deadline_s, what="a directory probe")
            try:
                conn.execute("SELECT 1")
            except TRANSIENT:
                self.watchdog.disarm(token)
                conn.close()
                continue
            if not self.watchdog.disarm(token):
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._open_conns.add(conn)
                self._idle.append(conn)
                self._down = False
            log.info(self._up_note)
            return
