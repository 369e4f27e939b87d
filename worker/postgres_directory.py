"""The node's directory client: synchronous batched lookups, write-behind registrations, placement
changes and touches, over its own PostgreSQL connections (the control plane's SQL, run through
`controlplane.node_api`; no ORM).

Lookups run on pooled reader connections with a short statement timeout and a deadline
(`postgres_readers`); from a failure until a background probe reaches the database again, the
client answers DirectoryUnavailable at once, so engines recompute instead of queueing behind a
dead database. Every write goes to one background writer thread: registrations and placement
changes are kept in order and retried until the database takes them; touches are summed per
block and dropped (counted) when they cannot be written. A write that gets no answer by its
deadline has its connection cut and is retried like any failed write. Every connection carries
the node's connect timeout, TCP keepalives and TCP user timeout (`network.ConnectionOptions`).

With a read replica (`DirectoryOptions.replica`), lookups and salts go to a streaming standby
while its measured staleness is within its bound, to the primary otherwise or when the standby
fails (`postgres_replica`); every write goes to the primary.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg

from controlplane import node_api
from worker.dataplane.directory import (
    BlockRegistration,
    BlockTouch,
    DirectoryStats,
    LookupResult,
    PlacementChange,
)
from worker.dataplane.network import Watchdog
from worker.postgres_options import Connect, DirectoryOptions, django_connect
from worker.postgres_readers import TRANSIENT, DirectoryReaders
from worker.postgres_replica import ReplicaReads

__all__ = ["DirectoryOptions", "PostgresDirectory", "django_connect"]

log = logging.getLogger("strata.directory")


@dataclasses.dataclass
class _Touch:
    hits: int
    at: float
    count: int


class PostgresDirectory:
    """The data plane's Directory backed by the control plane's PostgreSQL, over raw psycopg
    connections (Django's settings name the database; no ORM on this path)."""

    def __init__(
        self,
        *,
        connect: Connect | None = None,
        options: DirectoryOptions | None = None,
        announce: Callable[..., None] | None = None,
        source: str = "node",
    ) -> None:
        self.options = options or DirectoryOptions()
        self._connect_raw = connect or django_connect(connection=self.options.connection)
        self._announce = announce if announce is not None else node_api.blocks_registered_announce
        self._source = source
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._writes: collections.deque[tuple[str, Any]] = collections.deque()
        self._touches: dict[tuple[str, uuid.UUID, uuid.UUID], _Touch] = {}
        self._touches_since = 0.0  # when the oldest pending touch arrived
        self._accepted = 0  # writes ever accepted; with _settled they tell flush() when it is done
        self._settled = 0
        self._touch_epoch = 0
        self._touch_settled = 0
        self._flush_now = False
        self._stopping = False
        self._failing = 0
        self._counts = collections.Counter[str]()
        self._watchdog = Watchdog("strata-directory-watchdog")
        self._readers = DirectoryReaders(
            open_connection=lambda: self._open(timeout_ms=self.options.lookup_timeout_ms, reads=True),
            watchdog=self._watchdog,
            deadline_s=self.options.read_deadline_s,
            statement_ms=self.options.lookup_timeout_ms,
            retry_s=self.options.unavailable_s,
            count=self._count,
        )
        self._replica: ReplicaReads | None = None
        if (replica := self.options.replica) is not None:
            self._replica = ReplicaReads(
                options=replica,
                open_connection=lambda: self._open(
                    timeout_ms=self.options.lookup_timeout_ms, connect=replica.connect, reads=True
                ),
                primary=self._readers,
                count=self._count,
            )
        self._salts: dict[str, bytes] = {}
        self._shared: tuple[float, dict[str, bytes]] | None = None
        self._writer: psycopg.Connection[Any] | None = None
        self._unannounced = collections.Counter[str]()
        self._announced_at = 0.0
        self._parked: list[tuple[str, Any]] = []
        self._parked_at = 0.0
        self._unknown_since: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="strata-directory-writer", daemon=True)
        self._thread.start()

    # -- reads ---------------------------------------------------------------------------------
    def lookup(
        self,
        *,
        keys: Sequence[uuid.UUID],
        node: str | None,
        namespace: str | None = None,
        model_key: uuid.UUID | None = None,
        content_keys: Sequence[uuid.UUID] = (),
    ) -> LookupResult:
        with self._lock:
            self._counts["lookups"] += 1
        answer = self._read(
            lambda cur: node_api.directory_lookup(
                cur, namespace=namespace, model_key=model_key, node=node, prefix_keys=keys, content_keys=content_keys
            )
        )
        return node_api.lookup_result(answer, prefix_keys=keys, content_keys=content_keys)

    def namespace_salt(self, namespace: str) -> bytes:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._read(lambda cur: node_api.namespace_salt(cur, name=namespace))
            self._salts[namespace] = salt
        return salt

    def shared_salts(self) -> dict[str, bytes]:
        now = time.monotonic()
        if self._shared is None or now - self._shared[0] >= self.options.shared_refresh_s:
            self._shared = (now, self._read(node_api.shared_salts))
        return dict(self._shared[1])

    def _read(self, query: Callable[[psycopg.Cursor[Any]], Any]) -> Any:
        if self._replica is not None:
            return self._replica.read(query)
        answer = self._readers.read(query)
        self._count("primary_reads")
        return answer

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _open(self, *, timeout_ms: int, connect: Connect | None = None, reads: bool = False) -> psycopg.Connection[Any]:
        """A new connection (within the connect timeout) with its statement timeout set (within
        the read deadline: the path may have failed since the connection opened).

        A connection for `reads` prepares each statement at its first run and keeps one generic
        plan of it (`plan_cache_mode`): left to choose, the server plans a prepared lookup again at
        every run (a generic plan, which cannot know how many keys come, looks dearer than one made
        for the keys at hand), and planning is most of a short lookup's time: 1.1 ms for 8 keys
        planned each time, 0.28 ms on the one generic plan, which was no slower from 64 to 4096
        keys (benchmarks/README.md)."""
        conn = (connect or self._connect_raw)()
        token = self._watchdog.arm(conn.fileno(), self.options.read_deadline_s, what="a new directory connection")
        try:
            conn.autocommit = True
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), "
                "set_config('application_name', 'strata-directory', false), "
                "set_config('plan_cache_mode', %s, false)",
                (str(timeout_ms), "force_generic_plan" if reads else "auto"),
            )
            if reads:
                conn.prepare_threshold = 0
        except BaseException:
            self._watchdog.disarm(token)
            conn.close()
            raise
        if not self._watchdog.disarm(token):
            conn.close()
            raise psycopg.OperationalError("the directory database did not answer a new connection in time")
        return conn

    # -- writes (never wait) ---------------------------------------------------------------------
    def register(self, *, blocks: Sequence[BlockRegistration]) -> None:
        self._enqueue("register", [BlockRegistration.coerce(b) for b in blocks])

    def change_placements(self, *, changes: Sequence[PlacementChange]) -> None:
        self._enqueue("change", list(changes))

    def _enqueue(self, kind: str, items: list[Any]) -> None:
        if not items:
            return
        with self._lock:
            over = len(self._writes) + len(items) - self.options.capacity
            if over > 0:
                # Kept all the same: dropping a registration would leave bytes the directory
                # never learns of. The count says the writer cannot keep up.
                if self._counts["over_capacity"] == 0:
                    log.warning(
                        "directory write queue over capacity (%d): the database is not keeping up",
                        self.options.capacity,
                    )
                self._counts["over_capacity"] += min(over, len(items))
            was_idle = not self._writes
            self._writes.extend((kind, item) for item in items)
            self._accepted += len(items)
            self._counts["queued"] += len(items)
            if was_idle or len(self._writes) >= self.options.batch_size:
                self._wake.notify()

    def touch(self, *, touches: Sequence[BlockTouch]) -> None:
        with self._lock:
            if touches and not self._touches:
                self._touches_since = time.monotonic()
                self._wake.notify()
            for t in touches:
                self._counts["queued"] += 1
                key = (t.namespace, t.model_key, t.prefix_key)
                pending = self._touches.get(key)
                if pending is not None:
                    pending.hits += t.hits
                    pending.at = max(pending.at, t.at)
                    pending.count += 1
                elif len(self._touches) < self.options.touch_capacity:
                    self._touches[key] = _Touch(hits=t.hits, at=t.at, count=1)
                else:
                    self._counts["dropped_touches"] += 1
            self._touch_epoch += 1

    # -- control ---------------------------------------------------------------------------------
    def flush(self, *, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            target, touch_target = self._accepted, self._touch_epoch
            self._flush_now = True
            self._wake.notify()
            while self._settled < target or self._touch_settled < touch_target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._done.wait(remaining)
            return True

    def stats(self) -> DirectoryStats:
        with self._lock:
            c = self._counts
            return DirectoryStats(
                queued=c["queued"],
                pending=len(self._writes),
                flushed=c["flushed"],
                flushes=c["flushes"],
                retried=c["retried"],
                failed_flushes=c["failed_flushes"],
                dropped_touches=c["dropped_touches"],
                rejected=c["rejected"],
                refused_changes=c["refused_changes"],
                over_capacity=c["over_capacity"],
                lookups=c["lookups"],
                lookup_failures=c["lookup_failures"],
                read_deadlines=c["read_deadlines"],
                write_deadlines=c["write_deadlines"],
                deferred=len(self._parked),
                primary_reads=c["primary_reads"],
                replica_reads=c["replica_reads"],
                replica_lag_fallbacks=c["replica_lag_fallbacks"],
                replica_failure_fallbacks=c["replica_failure_fallbacks"],
                replica_staleness_s=None if self._replica is None else self._replica.staleness_s(),
            )

    def close(self, *, timeout: float = 5.0) -> None:
        self.flush(timeout=timeout)
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=timeout)
        if self._replica is not None:
            self._replica.close()
        self._readers.close()
        self._watchdog.close()
        with self._lock:
            left = len(self._writes)
        if left:
            log.warning("directory client closed with %d writes not written", left)

    def __enter__(self) -> PostgresDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.options.retry_initial_s
        while True:
            with self._lock:
                if self._parked and time.monotonic() - self._parked_at >= self.options.unknown_retry_s:
                    self._writes.extend(self._parked)
                    self._accepted += len(self._parked)
                    self._parked = []
                if not (self._stopping or self._flush_now or self._writes or self._touches_due()):
                    # Idle: sleep until something arrives, parked writes or pending touches are
                    # due, or registered blocks wait to be announced.
                    waits = [self.options.unknown_retry_s] if self._parked else []
                    waits += [self.options.announce_every_s] if self._unannounced["blocks"] else []
                    if self._touches:
                        waits.append(max(0.0, self._touches_since + self.options.touch_interval_s - time.monotonic()))
                    self._wake.wait(min(waits) if waits else None)
                deadline = time.monotonic() + self.options.flush_interval_s
                while not (self._stopping or self._flush_now or len(self._writes) >= self.options.batch_size):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wake.wait(remaining)
                if self._stopping:
                    self._reset_writer()
                    return
                flushing, self._flush_now = self._flush_now, False
                batch = list(itertools.islice(self._writes, self.options.batch_size))
                touches: dict[tuple[str, uuid.UUID, uuid.UUID], _Touch] = {}
                touch_epoch = self._touch_settled
                if flushing or self._touches_due():
                    touches, self._touches = self._touches, {}
                    touch_epoch = self._touch_epoch
            ok = self._write_batch(batch) if batch else True
            if ok:
                backoff = self.options.retry_initial_s
                self._write_touches(touches)
            else:
                self._drop_touches(touches)
            with self._lock:
                self._touch_settled = touch_epoch
                self._done.notify_all()
            if not ok:
                # Back off before the next attempt; only close() cuts the wait short (new writes
                # arriving during an outage must not turn the retry loop into a busy one).
                retry_at = time.monotonic() + backoff
                with self._lock:
                    while not self._stopping and (remaining := retry_at - time.monotonic()) > 0:
                        self._wake.wait(remaining)
                backoff = min(backoff * 2, self.options.retry_max_s)
            self._maybe_announce()

    def _touches_due(self) -> bool:
        """Pending touches go out now: the oldest waited its interval, or they fill half the
        room for them (or the client flushes or stops; the caller checks those). Under the lock."""
        return bool(self._touches) and (
            self._stopping
            or time.monotonic() - self._touches_since >= self.options.touch_interval_s
            or len(self._touches) >= max(1, self.options.touch_capacity // 2)
        )

    def _writer_conn(self) -> psycopg.Connection[Any]:
        if self._writer is None or self._writer.closed:
            self._writer = self._open(timeout_ms=self.options.write_timeout_ms)
        return self._writer

    @contextlib.contextmanager
    def _write_deadline(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Cut the writer's connection if what runs inside gets no answer by the write deadline
        (the write then fails as with a lost connection, and is retried); counted."""
        token = self._watchdog.arm(conn.fileno(), self.options.write_deadline_s, what="a directory write")
        try:
            yield
        finally:
            if not self._watchdog.disarm(token):
                self._count("write_deadlines")
                self._reset_writer()

    def _reset_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None

    def _write_batch(self, batch: list[tuple[str, Any]]) -> bool:
        """Write a batch in one transaction; a batch the database refuses for its content is split
        until the offending writes are found and rejected. False: try again later."""
        unknown: list[BlockRegistration] = []
        try:
            counts, unknown = self._apply(batch)
        except TRANSIENT as exc:
            self._reset_writer()
            with self._lock:
                self._counts["failed_flushes"] += 1
                self._counts["retried"] += len(batch)
                self._failing += 1
                failing = self._failing
            if failing == 1 or failing % 20 == 0:
                log.warning(
                    "directory write of %d items failed (%d in a row), will retry: %s", len(batch), failing, exc
                )
            return False
        except psycopg.Error as exc:
            if len(batch) == 1:
                log.error("directory refused %s: %s", batch[0][1], exc)
                counts = collections.Counter(rejected=1)
            else:
                half = len(batch) // 2
                return self._write_batch(batch[:half]) and self._write_batch(batch[half:])
        with self._lock:
            if self._failing:
                log.info("directory writes go through again after %d failed attempts", self._failing)
                self._failing = 0
            for _ in range(len(batch)):
                self._writes.popleft()
            self._settled += len(batch)
            self._counts["flushes"] += 1
            self._counts.update(counts)
            self._park(unknown)
            self._done.notify_all()
        return True

    def _park(self, unknown: list[BlockRegistration]) -> None:
        """Keep registrations that name what the directory does not know yet, for a while (call
        with the lock held); parked writes count as settled, so flush() does not wait on them."""
        now = time.monotonic()
        for reg in unknown:
            since = self._unknown_since.setdefault(id(reg), now)
            if now - since < self.options.unknown_grace_s:
                if not self._parked:
                    self._parked_at = now
                self._parked.append(("register", reg))
            else:
                del self._unknown_since[id(reg)]
                self._counts["rejected"] += 1
                log.warning(
                    "registration of %s rejected: its namespace, model or node is still unknown after %.0f s",
                    reg.prefix_key,
                    self.options.unknown_grace_s,
                )

    def _apply(self, batch: list[tuple[str, Any]]) -> tuple[collections.Counter[str], list[BlockRegistration]]:
        """Write a batch in one transaction; returns the counts and the registrations that name an
        unknown namespace, model or node (not written)."""
        counts = collections.Counter[str]()
        unknown: list[BlockRegistration] = []
        now = datetime.now(tz=UTC)
        conn = self._writer_conn()
        with self._write_deadline(conn), conn.transaction(), conn.cursor() as cur:
            for kind, run in _kinds(batch):
                if kind == "register":
                    written = node_api.registrations_write(cur, registrations=run, now=now, all_or_nothing=False)
                    unknown.extend(run[index] for index, _ in written.rejected)
                    counts.update(
                        flushed=written.written,
                        registered=written.written,
                        new_blocks=written.counts.blocks,
                        new_placements=written.counts.placements,
                    )
                else:
                    changed = node_api.placement_changes_write(cur, changes=run, now=now)
                    counts.update(flushed=len(run), refused_changes=max(len(run) - changed, 0))
        with self._lock:
            self._unannounced.update(
                blocks=counts["registered"], new=counts["new_blocks"], placements=counts["new_placements"]
            )
            parked = {id(reg) for reg in unknown}
            for reg in (r for kind, run in _kinds(batch) if kind == "register" for r in run):
                if id(reg) not in parked:
                    self._unknown_since.pop(id(reg), None)
        for name in ("registered", "new_blocks", "new_placements"):
            del counts[name]
        return counts, unknown

    def _write_touches(self, touches: dict[tuple[str, uuid.UUID, uuid.UUID], _Touch]) -> None:
        if not touches:
            return
        rows = [
            node_api.TouchRow(
                namespace=ns, model_key=mk, prefix_key=pk, hits=t.hits, at=datetime.fromtimestamp(t.at, tz=UTC)
            )
            for (ns, mk, pk), t in touches.items()
        ]
        try:
            conn = self._writer_conn()
            with self._write_deadline(conn), conn.cursor() as cur:
                node_api.touches_write(cur, rows=rows)
        except psycopg.Error as exc:
            if isinstance(exc, TRANSIENT):
                self._reset_writer()
            log.warning("dropped %d touches: %s", len(rows), exc)
            self._drop_touches(touches)
            return
        with self._lock:
            self._counts["flushed"] += sum(t.count for t in touches.values())

    def _drop_touches(self, touches: dict[tuple[str, uuid.UUID, uuid.UUID], _Touch]) -> None:
        if touches:
            with self._lock:
                self._counts["dropped_touches"] += sum(t.count for t in touches.values())

    def _maybe_announce(self) -> None:
        if time.monotonic() - self._announced_at < self.options.announce_every_s:
            return
        with self._lock:
            pending, self._unannounced = self._unannounced, collections.Counter()
        if not pending["blocks"]:
            return
        self._announced_at = time.monotonic()
        try:
            self._announce(
                blocks=pending["blocks"], new=pending["new"], placements=pending["placements"], source=self._source
            )
        except Exception as exc:  # noqa: BLE001 - the dashboard stream is lossy by design
            log.warning("could not announce registered blocks: %s", exc)


def _kinds(batch: list[tuple[str, Any]]) -> list[tuple[str, list[Any]]]:
    """Consecutive writes of one kind, in order: a change never overtakes a registration queued before it."""
    return [(kind, [item for _, item in run]) for kind, run in itertools.groupby(batch, key=lambda w: w[0])]
