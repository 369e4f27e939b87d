"""Lookups served by a real PostgreSQL streaming standby of the directory's database, with bounded,
measured staleness: a block registered while the standby lags is a miss there (never a wrong hit)
until the measured staleness passes the bound, then the primary answers; a standby that dies sends
lookups to the primary at once, and one that comes back serves them again."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from controlplane.runtime.environment import embedded_database_name
from controlplane.runtime.replica import StreamingStandby, streaming_standby
from worker.dataplane.config import ConfigError, load_config
from worker.dataplane.directory import BlockRegistration, DirectoryStats
from worker.postgres_directory import DirectoryOptions, PostgresDirectory
from worker.postgres_replica import ReplicaOptions

MAX_LAG_S = 1.0


@pytest.fixture
def standby(private_pg) -> Iterator[StreamingStandby]:  # type: ignore[no-untyped-def]
    server, _, _ = private_pg
    with streaming_standby(server) as started:
        yield started


@pytest.fixture
def directory(private_pg, standby) -> Iterator[PostgresDirectory]:  # type: ignore[no-untyped-def]
    _, connect, _ = private_pg
    options = DirectoryOptions(
        flush_interval_s=0.02,
        unavailable_s=0.1,
        read_deadline_s=2.0,
        replica=ReplicaOptions(url=standby.url(embedded_database_name()), max_lag_s=MAX_LAG_S, probe_s=0.05),
    )
    with PostgresDirectory(connect=connect, options=options, announce=lambda **_: None) as client:
        yield client


def registration(model_key: uuid.UUID) -> BlockRegistration:
    return BlockRegistration(
        namespace="tenant-a",
        model_key=model_key,
        prefix_key=uuid.uuid4(),
        content_key=uuid.uuid4(),
        position=0,
        tokens=16,
        tier="host",
        node="gpu-0",
        nbytes=512,
    )


def lookup(directory: PostgresDirectory, model_key: uuid.UUID, key: uuid.UUID) -> tuple[int, str]:
    """Prefix hits of one key, and which server answered ('replica' or 'primary')."""
    before = directory.stats()
    hits = directory.lookup(keys=[key], node="gpu-0", namespace="tenant-a", model_key=model_key).prefix_hit_blocks
    after = directory.stats()
    if after.replica_reads > before.replica_reads:
        return hits, "replica"
    assert after.primary_reads > before.primary_reads
    return hits, "primary"


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.02)


def registered(directory: PostgresDirectory, model_key: uuid.UUID) -> uuid.UUID:
    block = registration(model_key)
    directory.register(blocks=[block])
    assert directory.flush(timeout=10), directory.stats()
    return block.prefix_key


def standby_sql(standby: StreamingStandby, sql: str) -> object:
    with psycopg.connect(**standby.conninfo(embedded_database_name()), autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    return None if row is None else row[0]


def test_lookups_are_served_by_the_replica(private_pg, standby, directory):
    _, _, model_key = private_pg
    key = registered(directory, model_key)
    wait_for("a hit from the replica", lambda: lookup(directory, model_key, key) == (1, "replica"))
    stats: DirectoryStats = directory.stats()
    assert stats.replica_reads >= 1 and stats.replica_staleness_s is not None
    assert stats.replica_staleness_s <= MAX_LAG_S
    # The connections that answered are the standby's: it is in recovery, and they are there.
    assert standby_sql(standby, "SELECT pg_is_in_recovery()") is True
    assert standby_sql(standby, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'strata-directory'"), (
        "no directory connection on the standby"
    )
    # Registrations went to the primary (the standby refuses writes).
    assert stats.flushed == 1 and stats.rejected == 0


def test_a_block_registered_while_replay_is_paused_is_a_miss_then_found_on_the_primary(private_pg, standby, directory):
    _, _, model_key = private_pg
    warm = registered(directory, model_key)
    wait_for("the replica serving", lambda: lookup(directory, model_key, warm) == (1, "replica"))
    standby_sql(standby, "SELECT pg_wal_replay_pause()")
    paused_at = time.monotonic()
    key = registered(directory, model_key)

    # Within the bound: the replica answers, and the block is a miss there.
    assert lookup(directory, model_key, key) == (0, "replica")
    answers = []
    while (answer := lookup(directory, model_key, key))[0] == 0:
        answers.append(answer)
        assert time.monotonic() - paused_at < MAX_LAG_S + 3, answers[-3:]
        time.sleep(0.02)
    found_after = time.monotonic() - paused_at
    # Found once the measured staleness passed the bound, by the primary; never a hit from the
    # paused replica.
    assert answer == (1, "primary")
    assert found_after >= MAX_LAG_S - 0.2, found_after
    stats = directory.stats()
    assert stats.replica_lag_fallbacks >= 1
    assert stats.replica_staleness_s is not None and stats.replica_staleness_s > MAX_LAG_S
    assert all(a == (0, "replica") for a in answers), set(answers)

    standby_sql(standby, "SELECT pg_wal_replay_resume()")
    wait_for("the replica serving again", lambda: lookup(directory, model_key, key) == (1, "replica"))


def test_a_dead_standby_sends_lookups_to_the_primary_at_once_and_serves_again_when_back(
    private_pg, standby, directory, caplog
):
    caplog.set_level(logging.INFO, logger="strata.directory")
    _, _, model_key = private_pg
    key = registered(directory, model_key)
    wait_for("the replica serving", lambda: lookup(directory, model_key, key) == (1, "replica"))

    standby.stop(immediate=True)
    for _ in range(5):
        began = time.perf_counter()
        assert lookup(directory, model_key, key) == (1, "primary")
        assert time.perf_counter() - began < 0.5
    assert directory.stats().replica_failure_fallbacks >= 1

    standby.start()
    wait_for("the replica serving again", lambda: lookup(directory, model_key, key) == (1, "replica"))
    assert directory.stats().lookup_failures == 0
    # Said once each time the client changes where it reads, in the operator's words.
    said = [r.getMessage() for r in caplog.records if "directory reads go to" in r.getMessage()]
    assert len(said) == 3, said
    assert said[0].startswith("directory reads go to the read replica")
    assert said[1].startswith("directory reads go to the primary: the read replica failed")
    assert said[2].startswith("directory reads go to the read replica")


def test_a_replica_that_is_not_a_standby_never_serves(private_pg):
    """Pointed at a server that replays nothing (here the primary itself), the client cannot
    measure a staleness, so every read stays on the primary."""
    server, connect, model_key = private_pg
    options = DirectoryOptions(
        replica=ReplicaOptions(
            url=f"postgresql://postgres@/{embedded_database_name()}?host={server.sockets}",
            max_lag_s=0.5,
            probe_s=0.05,
        )
    )
    with PostgresDirectory(connect=connect, options=options, announce=lambda **_: None) as directory:
        for _ in range(10):
            assert lookup(directory, model_key, uuid.uuid4()) == (0, "primary")
            time.sleep(0.03)
        assert directory.stats().replica_reads == 0


@pytest.mark.parametrize(
    "url",
    ["http://db.example/strata", "postgresql://db.example", "postgresql://db.example:port/strata"],
)
def test_a_bad_replica_url_names_the_setting(url):
    with pytest.raises(ConfigError, match="STRATA_DIRECTORY_REPLICA_URL"):
        load_config(environ={"STRATA_DIRECTORY_REPLICA_URL": url})


def test_the_replica_settings_reach_the_client_options():
    config = load_config(
        environ={
            "STRATA_DIRECTORY_REPLICA_URL": "postgresql://strata@replica.example:5432/strata",
            "STRATA_DIRECTORY_REPLICA_MAX_LAG_SECONDS": "2.5",
        }
    )
    replica = DirectoryOptions.from_config(config).replica
    assert replica is not None and replica.url == "postgresql://strata@replica.example:5432/strata"
    assert replica.max_lag_s == 2.5 and replica.probe_s < 2.5
    assert replica.connection == DirectoryOptions.from_config(config).connection
    assert DirectoryOptions.from_config(load_config(environ={})).replica is None
    with pytest.raises(ConfigError, match="STRATA_DIRECTORY_REPLICA_MAX_LAG_SECONDS"):
        load_config(environ={"STRATA_DIRECTORY_REPLICA_MAX_LAG_SECONDS": "0"})
    with pytest.raises(ValueError, match="probe_s"):
        ReplicaOptions(url="postgresql://replica.example/strata", max_lag_s=0.5, probe_s=0.5)
