"""The control plane's services fail under a real node process: PostgreSQL restarts in the middle
of moves, and the broker (Redis) stops and restarts with movements queued and in flight. Each test
runs its own server, so stopping it disturbs nobody else. Afterwards every movement completes
(retries with backoff, redelivery, the redispatch sweep), I1-I4 hold and every block reads back
with its own bytes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis
from django.core.management import call_command
from django.db import connections

from controlplane.directory.models import Node, Placement
from controlplane.movements.choices import MovementState
from controlplane.movements.models import Movement
from controlplane.movements.services import movements_plan
from tests.movements.procs import (
    DRAIN_HOST,
    PrivatePostgres,
    PrivateRedis,
    control_plane,
    reconcile_and_check,
    served_bytes_check,
    state_of,
    tolerant,
    write_blocks,
)
from tests.support import wait_for

# -- PostgreSQL restarts during moves ----------------------------------------------------------------


@pytest.fixture
def private_postgres(tmp_path, django_db_blocker) -> Iterator[PrivatePostgres]:
    """A migrated PostgreSQL of this test alone; this process's Django connection points at it
    for the test and back at the shared server afterwards."""
    server = PrivatePostgres(tmp_path / "pg")
    server.start()
    connection = connections["default"]
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(NAME="strata", HOST=server.socket_dir, PORT="")
    try:
        with django_db_blocker.unblock():
            call_command("migrate", verbosity=0, interactive=False)
            yield server
    finally:
        connections.close_all()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
        server.stop()


@pytest.mark.integration
def test_moves_complete_after_postgresql_restarts_mid_move(private_postgres, node_factory, subprocess_env):
    env = {**subprocess_env, "DATABASE_URL": private_postgres.url()}
    # The deployment's own settings (visibility timeout of an hour): recovery here is the task's
    # retries with backoff, not a redelivery.
    nodes = node_factory(env=env, settings_module="controlplane.settings.test", tiers="device,host,disk")
    process, log = nodes.start(STRATA_FAULT_POINT="after-copy", STRATA_FAULT_HOLD_S="1.5")
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        seeds = write_blocks(store, profile, nodes.name, 6)
        result = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(result.written) == 6
        wait_for(lambda: "held at after-copy" in log.read_text(), timeout=60, what="the first move to be copied")
        print(f"stopping PostgreSQL: {private_postgres.stop()}")
        time.sleep(5)  # the held move resumes into a database that is gone
        print(f"starting PostgreSQL: {private_postgres.start()}")
        connections.close_all()
        wait_for(
            lambda: tolerant(lambda: all(state_of(i) == MovementState.DONE for i in result.written)),
            timeout=120,
            what="every move to finish after the restart",
            every=0.5,
        )
        # The interrupted moves failed on the lost database and ran again (the task's retry).
        assert max(Movement.objects.filter(id__in=result.written).values_list("attempts", flat=True)) >= 2
        assert process.poll() is None, "the node survived the database restart"
        assert (
            sorted(Placement.objects.filter(block__prefix_key__in=seeds).values_list("tier", "state"))
            == [("disk", "ready")] * 6
        )
        assert served_bytes_check(store, seeds) == {"served": 6, "missed": 0}
        reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    finally:
        store.close()


# -- the broker stops and restarts -----------------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "broker")
    server.start()
    try:
        yield server
    finally:
        server.stop()


_PLAN = (
    "import json; from tests.movements.procs import DRAIN_HOST; "
    "from controlplane.movements.services import movements_plan; "
    "print(json.dumps(movements_plan(snapshot=DRAIN_HOST, node={node!r}, reason='manual').written))"
)
_REDISPATCH = (
    "import json, datetime; from controlplane.movements.services import movements_redispatch; "
    "print(json.dumps(movements_redispatch(older_than=datetime.timedelta(0))))"
)


def _last_json(output: str) -> object:
    return json.loads([line for line in output.splitlines() if line.startswith(("[", "{"))][-1])


def _host_reported(nodes, store) -> bool:  # type: ignore[no-untyped-def]
    used = store.tier("host").usage().used_bytes
    return Node.objects.get(name=nodes.name).tiers.filter(tier="host", used_bytes=used).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.integration
def test_movements_survive_a_broker_restart(private_redis, node_factory, subprocess_env, python):
    # Broker, cache and events of the node and of the planning process live in the private Redis.
    env = {**subprocess_env, "REDIS_URL": private_redis.url()}
    # One worker thread, the deployment's own visibility timeout: a batch sent while that thread
    # is busy waits in the broker's queue, and nothing is delivered twice.
    nodes = node_factory(env=env, settings_module="controlplane.settings.test", tiers="device,host,disk", concurrency=1)
    process, log = nodes.start(STRATA_FAULT_POINT="after-copy", STRATA_FAULT_HOLD_S="10")
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    broker = redis.Redis.from_url(private_redis.url())
    try:
        first = write_blocks(store, profile, nodes.name, 3)
        in_flight = _last_json(control_plane(env, python, _PLAN.format(node=nodes.name)))
        assert len(in_flight) == 3
        wait_for(lambda: "held at after-copy" in log.read_text(), timeout=60, what="the node to start moving")

        second = write_blocks(store, profile, nodes.name, 3, seed=200)
        wait_for(lambda: _host_reported(nodes, store), what="the new host use in a heartbeat")
        queued = _last_json(control_plane(env, python, _PLAN.format(node=nodes.name)))
        assert sorted(queued) == sorted(
            Movement.objects.filter(block__prefix_key__in=second).values_list("id", flat=True)
        )
        assert broker.llen(f"node.{nodes.name}") == 1

        print(f"stopping the broker: {private_redis.stop()}")
        third = write_blocks(store, profile, nodes.name, 2, seed=300)
        wait_for(lambda: _host_reported(nodes, store), what="the new host use in a heartbeat")
        output = control_plane(env, python, _PLAN.format(node=nodes.name))
        stranded = _last_json(output)
        assert len(stranded) == 2 and "they stay planned" in output
        assert {state_of(i) for i in stranded} == {MovementState.PLANNED}
        time.sleep(3)
        print(f"starting the broker: {private_redis.start()}")
        broker = redis.Redis.from_url(private_redis.url())

        # The queued batch survived the restart (append-only file) and the node reconnects to it.
        wait_for(
            lambda: all(state_of(i) == MovementState.DONE for i in in_flight + queued),
            timeout=120,
            what="the in-flight and queued moves to finish after the broker restart",
        )
        assert {state_of(i) for i in stranded} == {MovementState.PLANNED}
        # The redispatch sweep (a beat job) queues what could not be sent.
        swept = _last_json(control_plane(env, python, _REDISPATCH))
        assert swept == {"requeued": 2, "cancelled": 0}
        wait_for(
            lambda: all(state_of(i) == MovementState.DONE for i in stranded), timeout=60, what="the redispatched moves"
        )
        assert process.poll() is None, "the node survived the broker outage"
        assert "Connection to broker lost" in log.read_text() or "Cannot connect" in log.read_text()
        seeds = {**first, **second, **third}
        assert (
            sorted(Placement.objects.filter(block__prefix_key__in=seeds).values_list("tier", "state"))
            == [("disk", "ready")] * 8
        )
        assert served_bytes_check(store, seeds) == {"served": 8, "missed": 0}
        reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    finally:
        broker.close()
        store.close()
