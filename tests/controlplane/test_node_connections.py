"""A node's connections carry its timeouts and keepalives: the directory client's, Django's, the
L3 Redis client's and the Celery broker's; bad values stop the node naming the option and range."""

from __future__ import annotations

import copy
import socket
import uuid

import pytest
from django.conf import settings

from worker.dataplane.config import ConfigError, load_config
from worker.dataplane.network import ConnectionOptions, Watchdog
from worker.dataplane.tiers.remote import redis_client

NODE = {
    "STRATA_DB_CONNECT_TIMEOUT_SECONDS": "3",
    "STRATA_DB_STATEMENT_TIMEOUT_SECONDS": "12.5",
    "STRATA_TCP_KEEPALIVE_IDLE_SECONDS": "7",
    "STRATA_TCP_KEEPALIVE_INTERVAL_SECONDS": "4",
    "STRATA_TCP_KEEPALIVE_COUNT": "5",
    "STRATA_TCP_USER_TIMEOUT_SECONDS": "9",
    "STRATA_REDIS_HEALTH_CHECK_SECONDS": "6",
    "STRATA_BROKER_TIMEOUT_SECONDS": "8",
    "STRATA_LOOKUP_DEADLINE_SECONDS": "1.5",
}
LIBPQ = {
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "7",
    "keepalives_interval": "4",
    "keepalives_count": "5",
    "tcp_user_timeout": "9000",
}


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"STRATA_DB_CONNECT_TIMEOUT_SECONDS": "1"}, "STRATA_DB_CONNECT_TIMEOUT_SECONDS: must be 2 to 60 seconds"),
        ({"STRATA_DB_CONNECT_TIMEOUT_SECONDS": "2.5"}, "STRATA_DB_CONNECT_TIMEOUT_SECONDS: invalid literal"),
        ({"STRATA_DB_STATEMENT_TIMEOUT_SECONDS": "0"}, "STRATA_DB_STATEMENT_TIMEOUT_SECONDS: must be 0.1 to 3600"),
        ({"STRATA_TCP_KEEPALIVE_IDLE_SECONDS": "0"}, "STRATA_TCP_KEEPALIVE_IDLE_SECONDS: must be 1 to 3600 seconds"),
        ({"STRATA_TCP_KEEPALIVE_INTERVAL_SECONDS": "601"}, "STRATA_TCP_KEEPALIVE_INTERVAL_SECONDS: must be 1 to 600"),
        ({"STRATA_TCP_KEEPALIVE_COUNT": "51"}, "STRATA_TCP_KEEPALIVE_COUNT: must be 1 to 50 probes"),
        ({"STRATA_TCP_USER_TIMEOUT_SECONDS": "0.1"}, "STRATA_TCP_USER_TIMEOUT_SECONDS: must be 0.5 to 600 seconds"),
        ({"STRATA_TCP_USER_TIMEOUT_SECONDS": "nan"}, "STRATA_TCP_USER_TIMEOUT_SECONDS: must be 0.5 to 600 seconds"),
        ({"STRATA_REDIS_HEALTH_CHECK_SECONDS": "-1"}, "STRATA_REDIS_HEALTH_CHECK_SECONDS: must be 0 to 3600 seconds"),
        ({"STRATA_BROKER_TIMEOUT_SECONDS": "1"}, "STRATA_BROKER_TIMEOUT_SECONDS: must be 2 to 300 seconds"),
    ],
)
def test_bad_connection_options_name_the_option_and_the_range(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_the_options_come_from_the_node_configuration():
    options = ConnectionOptions.from_config(load_config(environ=NODE))
    assert options.libpq() == {key: int(value) for key, value in LIBPQ.items()}
    assert options.statement_timeout_ms() == 12_500
    keepalive = options.socket_keepalive_options()
    assert keepalive[socket.TCP_KEEPIDLE] == 7 and keepalive[socket.TCP_KEEPCNT] == 5
    assert keepalive[socket.TCP_USER_TIMEOUT] == 9000
    broker = options.broker_transport()
    assert broker["socket_connect_timeout"] == 8 and "socket_timeout" not in broker  # pidbox sits idle
    assert options.redis()["health_check_interval"] == 6


@pytest.mark.django_db
def test_the_directory_clients_connections_carry_them():
    from worker.postgres_directory import DirectoryOptions, PostgresDirectory

    options = DirectoryOptions.from_config(load_config(environ=NODE))
    assert options.read_deadline_s == 1.5 and options.write_timeout_ms == 12_500
    with PostgresDirectory(options=options, announce=lambda **_: None) as client:
        reads = client._readers
        client.lookup(keys=[uuid.uuid4()], node="gpu-0")
        conn = reads._idle[0]
        assert LIBPQ.items() <= conn.info.get_parameters().items()
        assert conn.execute("SHOW statement_timeout").fetchone() == ("250ms",)


@pytest.mark.django_db
def test_djangos_connection_of_a_node_carries_them_and_its_statement_timeout():
    from django.db.backends.postgresql.base import DatabaseWrapper

    from worker.connections import database_options_apply

    databases = copy.deepcopy(settings.DATABASES)
    databases["default"].setdefault("OPTIONS", {})["options"] = "-c statement_timeout=5 -c work_mem=8MB"
    applied = database_options_apply(load_config(environ=NODE), databases=databases)
    assert applied["options"] == "-c work_mem=8MB -c statement_timeout=12500"
    probe = DatabaseWrapper(databases["default"], alias="node-probe")
    try:
        with probe.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone() == ("12500ms",)
            cursor.execute("SHOW work_mem")
            assert cursor.fetchone() == ("8MB",)
        assert LIBPQ.items() <= probe.connection.info.get_parameters().items()
    finally:
        probe.close()


def test_the_broker_connection_of_a_node_carries_them():
    from celery import Celery

    from worker.connections import broker_options_apply

    app = Celery("probe", set_as_current=False)
    app.conf.broker_url = settings.CELERY_BROKER_URL
    app.conf.broker_transport_options = {"visibility_timeout": 3600}
    applied = broker_options_apply(app, load_config(environ=NODE))
    assert applied["visibility_timeout"] == 3600 and app.conf.broker_connection_timeout == 8
    with app.connection_for_write() as conn:
        kwargs = conn.default_channel.client.connection_pool.connection_kwargs
        assert kwargs.get("socket_timeout") is None and kwargs["health_check_interval"] == 6


def test_the_l3_client_carries_them_over_tcp_and_the_timeouts_over_a_socket():
    options = ConnectionOptions.from_config(load_config(environ=NODE))
    tcp = redis_client("redis://127.0.0.1:1/0", timeout_s=0.5, connection=options).connection_pool.connection_kwargs
    assert tcp["socket_keepalive"] and tcp["socket_keepalive_options"] == options.socket_keepalive_options()
    assert tcp["socket_timeout"] == 0.5 and tcp["health_check_interval"] == 6
    unix = redis_client("unix:///tmp/none.sock", connection=options).connection_pool.connection_kwargs
    assert "socket_keepalive" not in unix and unix["health_check_interval"] == 6


def test_the_watchdog_cuts_a_call_past_its_deadline_and_leaves_the_others():
    watchdog = Watchdog()
    left, right = socket.socketpair()
    try:
        left.settimeout(5)
        token = watchdog.arm(left.fileno(), 0.2, what="a test read")
        assert left.recv(1) == b""  # woken by the cut, as by a peer that closed
        assert not watchdog.disarm(token) and watchdog.cuts == 1
        other, peer = socket.socketpair()
        with other, peer:
            token = watchdog.arm(other.fileno(), 5)
            peer.sendall(b"x")
            assert other.recv(1) == b"x" and watchdog.disarm(token)
    finally:
        watchdog.close()
        left.close()
        right.close()
