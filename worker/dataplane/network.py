"""How a node's connections to PostgreSQL and Redis give up on a path that stops answering.

A path that drops packets (rather than refusing them) leaves a client waiting until TCP itself
gives up, about 15 minutes. Every connection of a node therefore carries a connect timeout, TCP
keepalives (an idle connection whose peer vanished is found dead in seconds) and a TCP user
timeout (bytes sent and never acknowledged fail the connection in seconds); PostgreSQL's
statement timeout bounds the server's side, redis-py's socket timeout and health checks Redis's.

None of these fires while the peer's kernel still acknowledges bytes that nothing answers (a
stalled proxy, a server that stopped reading): `Watchdog` bounds that wait, call by call, by
shutting the stuck socket down, which wakes the thread blocked on it with an error at once.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any

log = logging.getLogger("strata.network")


@dataclasses.dataclass(frozen=True)
class ConnectionOptions:
    """Timeouts and keepalives of a node's connections (the node options of the same names)."""

    connect_timeout_s: int = 2
    """PostgreSQL: seconds to establish a connection (libpq's minimum is 2)."""
    statement_timeout_s: float = 30.0
    """PostgreSQL: the server cancels a statement of the node's after this long."""
    keepalive_idle_s: int = 5
    """Seconds a connection sits idle before TCP probes the peer."""
    keepalive_interval_s: int = 2
    """Seconds between two unanswered probes."""
    keepalive_count: int = 3
    """Unanswered probes after which the connection is dead."""
    user_timeout_s: float = 10.0
    """Seconds sent bytes may stay unacknowledged before the connection is dead (TCP_USER_TIMEOUT)."""
    health_check_s: float = 15.0
    """Redis: a connection idle this long is PINGed before its next command (0: never)."""
    broker_timeout_s: float = 10.0
    """Redis as the Celery broker: seconds to connect, and to wait for an answer."""

    @classmethod
    def from_config(cls, config: Any) -> ConnectionOptions:
        """From a `NodeConfig` (its db_*, tcp_*, redis_* and broker_* options)."""
        return cls(
            connect_timeout_s=config.db_connect_timeout_seconds,
            statement_timeout_s=config.db_statement_timeout_seconds,
            keepalive_idle_s=config.tcp_keepalive_idle_seconds,
            keepalive_interval_s=config.tcp_keepalive_interval_seconds,
            keepalive_count=config.tcp_keepalive_count,
            user_timeout_s=config.tcp_user_timeout_seconds,
            health_check_s=config.redis_health_check_seconds,
            broker_timeout_s=config.broker_timeout_seconds,
        )

    def libpq(self) -> dict[str, int]:
        """libpq connection parameters: connect timeout, keepalives and TCP user timeout (a unix
        socket ignores the TCP ones)."""
        return {
            "connect_timeout": self.connect_timeout_s,
            "keepalives": 1,
            "keepalives_idle": self.keepalive_idle_s,
            "keepalives_interval": self.keepalive_interval_s,
            "keepalives_count": self.keepalive_count,
            "tcp_user_timeout": int(self.user_timeout_s * 1000),
        }

    def statement_timeout_ms(self) -> int:
        return max(1, int(self.statement_timeout_s * 1000))

    def socket_keepalive_options(self) -> dict[int, int]:
        """TCP options of a Redis connection (redis-py sets them with socket_keepalive): the
        keepalive timing, and the TCP user timeout where the platform has one."""
        options: dict[int, int] = {}
        for name, value in (
            ("TCP_KEEPIDLE", self.keepalive_idle_s),
            ("TCP_KEEPINTVL", self.keepalive_interval_s),
            ("TCP_KEEPCNT", self.keepalive_count),
            ("TCP_USER_TIMEOUT", int(self.user_timeout_s * 1000)),
        ):
            if (constant := getattr(socket, name, None)) is not None:
                options[constant] = value
        return options

    def redis(self) -> dict[str, Any]:
        """redis-py client options besides the socket timeouts: keepalives and health checks."""
        return {
            "socket_keepalive": True,
            "socket_keepalive_options": self.socket_keepalive_options(),
            "health_check_interval": self.health_check_s,
        }

    def broker_transport(self) -> dict[str, Any]:
        """kombu's Redis transport options for the node's broker connection: a connect timeout,
        keepalives and health checks, but no read timeout. The remote-control (pidbox) pub/sub
        connection sits idle between broadcasts: a read timeout there reads as a lost broker, and
        the consumer's restart after it takes messages a busy worker should have left queued
        (`test_movements_survive_a_broker_restart`)."""
        return {
            "socket_connect_timeout": self.broker_timeout_s,
            "socket_keepalive": True,
            "socket_keepalive_options": self.socket_keepalive_options(),
            "health_check_interval": self.health_check_s,
        }


@dataclasses.dataclass
class _Armed:
    fileno: int
    deadline: float
    what: str
    cut: bool = False


class Watchdog:
    """Cuts connections stuck past their deadline. `arm` a socket (by file descriptor) before a
    call on it and `disarm` it after: a call still running at its deadline has its socket shut
    down in both directions, so the thread blocked on it wakes with a connection error, as when
    the peer closes. The caller must keep the socket open while it is armed (close after
    `disarm`), and drop the connection when `disarm` says it was cut.

    One thread serves every armed socket; it starts with the first `arm`."""

    def __init__(self, name: str = "strata-watchdog") -> None:
        self.name = name
        self._lock = threading.Condition()
        self._armed: dict[int, _Armed] = {}
        self._heap: list[tuple[float, int]] = []
        self._tokens = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.cuts = 0
        """Sockets cut so far."""

    def arm(self, fileno: int, seconds: float, *, what: str = "call") -> int:
        """Watch `fileno` for `seconds`; returns the token `disarm` takes."""
        deadline = time.monotonic() + seconds
        with self._lock:
            token = next(self._tokens)
            self._armed[token] = _Armed(fileno, deadline, what)
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._lock.notify()
        return token

    def disarm(self, token: int) -> bool:
        """Stop watching; True when the call ended in time, False when its socket was cut."""
        with self._lock:
            armed = self._armed.pop(token, None)
        return armed is not None and not armed.cut

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._armed):
                    _, token = heapq.heappop(self._heap)
                    armed = self._armed.get(token)
                    if armed is not None and not armed.cut:
                        armed.cut = True
                        self.cuts += 1
                        _shut_down(armed.fileno, armed.what)
                self._lock.wait(self._heap[0][0] - now if self._heap else None)


def _shut_down(fileno: int, what: str) -> None:
    """Shut a socket down through a duplicate of its descriptor (the owner closes its own)."""
    log.warning("%s got no answer by its deadline: its connection is cut", what)
    try:
        sock = socket.socket(fileno=os.dup(fileno))
    except OSError as exc:
        log.warning("could not cut a stuck connection: %s", exc)
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already shut down or disconnected: the blocked call returns on its own
    finally:
        sock.close()
