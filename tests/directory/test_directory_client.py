"""The node's write-behind Directory on real PostgreSQL: round trips, fast failure, no lost writes."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import psycopg
import pytest

from controlplane.directory.models import Block, Placement
from tests.directory.conftest import node_create
from worker.dataplane.directory import BlockTouch, DirectoryUnavailable, PlacementChange
from worker.postgres_directory import DirectoryOptions, PostgresDirectory, django_connect

pytestmark = pytest.mark.django_db(transaction=True)

FAST = DirectoryOptions(flush_interval_s=0.02, batch_size=500)


@pytest.fixture
def directory():
    events = []
    client = PostgresDirectory(options=FAST, announce=lambda **payload: events.append(payload), source="node:gpu-0")
    client.events = events
    yield client
    client.close()


def test_register_lookup_touch_and_change_round_trip(directory, registration, profile):
    regs = [registration(position=16 * i) for i in range(3)]
    directory.register(blocks=regs)
    assert directory.flush(timeout=10)
    result = directory.lookup(
        keys=[r.prefix_key for r in regs], node="gpu-0", namespace="tenant-a", model_key=profile.model_key
    )
    assert result.prefix_hit_blocks == 3 and set(result.values()) == {"host"}
    directory.touch(
        touches=[BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=regs[0].prefix_key, hits=2)]
        * 3
    )
    directory.change_placements(
        changes=[
            PlacementChange(
                namespace="tenant-a",
                model_key=profile.model_key,
                prefix_key=regs[1].prefix_key,
                tier="host",
                node="gpu-0",
                action="corrupt",
                expected_epoch=1,
            )
        ]
    )
    assert directory.flush(timeout=10)
    assert Block.objects.get(prefix_key=regs[0].prefix_key).access_count == 6
    assert Placement.objects.get(block__prefix_key=regs[1].prefix_key).state == "corrupt"
    again = directory.lookup(
        keys=[r.prefix_key for r in regs], node="gpu-0", namespace="tenant-a", model_key=profile.model_key
    )
    assert again.prefix_hit_blocks == 1
    stats = directory.stats()
    assert (stats.queued, stats.flushed, stats.pending, stats.dropped_touches, stats.lookups) == (7, 7, 0, 0, 2)


def test_lookups_run_one_prepared_generic_plan(directory, registration, profile):
    """The lookup is planned once per reader connection, not at every lookup: planning was most of
    a short lookup's time."""
    regs = [registration(position=16 * i) for i in range(8)]
    directory.register(blocks=regs)
    assert directory.flush(timeout=10)
    for _ in range(12):
        directory.lookup(
            keys=[r.prefix_key for r in regs], node="gpu-0", namespace="tenant-a", model_key=profile.model_key
        )
    plans = directory._read(
        lambda cur: cur.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%unnest%WITH ORDINALITY%"],
        ).fetchall()
    )
    assert plans, "the lookup was not prepared on the reader connection"
    generic, custom = plans[0]
    assert (generic, custom) == (12, 0), plans


def test_namespace_salt_comes_from_the_directory(directory, namespace):
    assert directory.namespace_salt("tenant-a") == bytes.fromhex(namespace.salt)


def test_registrations_may_be_any_object_with_the_fields(directory, namespace, profile, node):
    stored = SimpleNamespace(
        namespace="tenant-a",
        model_key=profile.model_key,
        prefix_key=uuid.uuid4(),
        content_key=uuid.uuid4(),
        position=0,
        tokens=16,
        tier="host",
        node="gpu-0",
        nbytes=4096,
        checksum="1" * 32,
    )
    directory.register(blocks=[stored])
    assert directory.flush(timeout=10)
    hits = directory.lookup(keys=[stored.prefix_key, uuid.uuid4()], node="gpu-0")
    assert dict(hits) == {stored.prefix_key: "host"}


def test_stale_epochs_and_unknown_references_are_counted_not_retried(registration, profile):
    directory = PostgresDirectory(
        options=DirectoryOptions(flush_interval_s=0.02, unknown_grace_s=0), announce=lambda **_: None
    )
    reg = registration()
    directory.register(blocks=[reg, registration(node="gpu-404"), registration(namespace="nobody")])
    directory.change_placements(
        changes=[
            PlacementChange(
                namespace="tenant-a",
                model_key=profile.model_key,
                prefix_key=reg.prefix_key,
                tier="host",
                node="gpu-0",
                action="deleting",
                expected_epoch=9,
            )
        ]
    )
    assert directory.flush(timeout=10)
    stats = directory.stats()
    directory.close()
    assert (stats.rejected, stats.refused_changes, stats.pending, stats.retried) == (2, 1, 0, 0)
    assert Placement.objects.get().state == "ready"


def test_registrations_wait_for_a_node_that_has_not_sent_its_first_heartbeat(registration, profile):
    """The engine may write blocks before the node's first heartbeat creates its row."""
    options = DirectoryOptions(flush_interval_s=0.02, unknown_retry_s=0.1, unknown_grace_s=30)
    with PostgresDirectory(options=options, announce=lambda **_: None) as client:
        early = registration(node="gpu-late")
        client.register(blocks=[early])
        assert client.flush(timeout=10)
        assert (client.stats().deferred, client.stats().rejected) == (1, 0)
        node_create("gpu-late")
        deadline = time.monotonic() + 10
        while client.stats().deferred and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.flush(timeout=10)
        stats = client.stats()
        assert (stats.deferred, stats.rejected, stats.pending) == (0, 0, 0)
    assert Placement.objects.get(block__prefix_key=early.prefix_key).node.name == "gpu-late"


def test_unknown_references_are_rejected_after_the_grace_period(registration):
    options = DirectoryOptions(flush_interval_s=0.02, unknown_retry_s=0.05, unknown_grace_s=0.2)
    with PostgresDirectory(options=options, announce=lambda **_: None) as client:
        client.register(blocks=[registration(namespace="never")])
        deadline = time.monotonic() + 10
        while not client.stats().rejected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (client.stats().rejected, client.stats().deferred) == (1, 0)
    assert not Block.objects.exists()


def test_writes_never_wait_and_are_announced_in_batches(directory, registration, profile):
    regs = [registration(position=16 * (i % 100)) for i in range(5000)]
    # The database write is held up until every registration has been handed over: had any
    # register() call waited for a write, this loop could not finish while the writer is stuck.
    release, writing = threading.Event(), threading.Event()
    real_apply = directory._apply

    def held_apply(batch):  # type: ignore[no-untyped-def]
        writing.set()
        assert release.wait(timeout=60), "the test never released the writer"
        return real_apply(batch)

    directory._apply = held_apply
    try:
        for start in range(0, len(regs), 50):
            directory.register(blocks=regs[start : start + 50])
        assert writing.wait(timeout=10), "the writer never started"
        assert not Block.objects.exists()  # every call returned while nothing was written yet
    finally:
        release.set()
    assert directory.flush(timeout=30)
    assert Block.objects.count() == 5000 and Placement.objects.count() == 5000
    # At most one event a second, each summing the batches since the last.
    deadline = time.monotonic() + 5
    while sum(e["blocks"] for e in directory.events) < 5000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(e["blocks"] for e in directory.events) == 5000
    assert sum(e["new"] for e in directory.events) == 5000
    assert len(directory.events) <= 3
    assert all(e["source"] == "node:gpu-0" for e in directory.events)


def test_touches_over_capacity_are_dropped_and_counted(registration, profile):
    with PostgresDirectory(options=DirectoryOptions(flush_interval_s=5, touch_capacity=2)) as client:
        client.touch(
            touches=[
                BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=uuid.uuid4()) for _ in range(5)
            ]
        )
        assert client.stats().dropped_touches == 3


def _accesses(prefix_key: uuid.UUID) -> int:
    return Block.objects.get(prefix_key=prefix_key).access_count


def test_touches_of_a_block_are_summed_on_the_node_for_the_touch_interval(registration, profile):
    """Touches wait out `touch_interval_s` and reach the table as one update per block (hot blocks
    are not updated once per write batch); registrations meanwhile go out at once."""
    reg = registration()
    options = DirectoryOptions(flush_interval_s=0.02, touch_interval_s=1.5)
    with PostgresDirectory(options=options, announce=lambda **_: None) as client:
        client.register(blocks=[reg])
        assert client.flush(timeout=10)
        touch = BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=reg.prefix_key, hits=2)
        began = time.monotonic()
        client.touch(touches=[touch])
        client.touch(touches=[touch, touch])
        later = registration()
        client.register(blocks=[later])
        deadline = time.monotonic() + 10
        while not Block.objects.filter(prefix_key=later.prefix_key).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert Block.objects.filter(prefix_key=later.prefix_key).exists()
        if time.monotonic() - began < 1.0:  # a slow machine may have taken the interval already
            assert _accesses(reg.prefix_key) == 0
        while _accesses(reg.prefix_key) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _accesses(reg.prefix_key) == 6
        assert time.monotonic() - began >= 1.4
        assert client.stats().flushed == 5  # two registrations and three touches


def test_a_flush_sends_pending_touches_at_once(registration, profile):
    reg = registration()
    with PostgresDirectory(options=DirectoryOptions(touch_interval_s=600), announce=lambda **_: None) as client:
        client.register(blocks=[reg])
        client.touch(touches=[BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=reg.prefix_key)])
        began = time.monotonic()
        assert client.flush(timeout=10)
        assert time.monotonic() - began < 5
        assert _accesses(reg.prefix_key) == 1


def test_the_touch_interval_must_be_positive():
    with pytest.raises(ValueError, match="touch_interval_s: must be greater than zero"):
        DirectoryOptions(touch_interval_s=0)


def test_lookups_fail_fast_when_the_database_is_unreachable(tmp_path):
    def unreachable():
        return psycopg.connect(host=str(tmp_path), dbname="strata", user="postgres", connect_timeout=2)

    with PostgresDirectory(connect=unreachable, options=DirectoryOptions(unavailable_s=30)) as client:
        started = time.perf_counter()
        with pytest.raises(DirectoryUnavailable):
            client.lookup(keys=[uuid.uuid4()], node="gpu-0")
        first = time.perf_counter() - started
        started = time.perf_counter()
        with pytest.raises(DirectoryUnavailable, match="a moment ago"):
            client.lookup(keys=[uuid.uuid4()], node="gpu-0")
        second = time.perf_counter() - started
        assert first < 0.5 and second < 0.01
        assert client.stats().lookup_failures == 2


def test_slow_lookups_time_out():
    with PostgresDirectory(connect=django_connect(), options=DirectoryOptions(lookup_timeout_ms=50)) as client:
        with pytest.raises(DirectoryUnavailable, match="took over 50 ms"):
            client._read(lambda cur: cur.execute("SELECT pg_sleep(1)"))
