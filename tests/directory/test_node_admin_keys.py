"""Per-node admin keys and the address check, against the real PostgreSQL and real HTTP servers:
each node's key (issued with its credential) opens that node's operator endpoints and no other's;
the control plane sends a node its own key, the new one after a rotation and nothing after a
revocation; a node that reports an address other than where its heartbeat came from, or a
malformed one, is sent nothing at all (a recording server sees no request); `seen_from` is the
database's record of the connection, whatever a node writes."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection as control_plane

from controlplane.dashboard.selectors import requests_recent
from controlplane.directory.models import Node
from controlplane.directory.services.credentials import (
    node_credential_create,
    node_credential_revoke,
    node_credential_rotate,
)
from controlplane.runtime.node_addresses import allow_list_parse
from controlplane.telemetry.metrics import NODE_ADDRESS_REFUSED
from tests.directory.conftest import node_create
from tests.support import free_port
from worker.dataplane.connectors.status import StatusServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


class _Metrics:
    def render(self) -> bytes:
        return b"# no metrics\n"


class Recorder:
    """An HTTP server that answers every GET with `status` and records the path and the
    Authorization header of each request it received."""

    def __init__(self, host: str = "127.0.0.1", status: int = 200, location: str = "") -> None:
        self.seen: list[tuple[str, str]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                recorder.seen.append((self.path, self.headers.get("Authorization", "")))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"requests": []}')

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.port = int(self.httpd.server_address[1])
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder(host="0.0.0.0")  # noqa: S104 - reached at a non-loopback address of this machine too
    yield server
    server.close()


def _status_server(node: str, key: str) -> StatusServer:
    return StatusServer(
        metrics=_Metrics(),  # type: ignore[arg-type]
        traces=list,
        node=node,
        host="127.0.0.1",
        port=free_port(),
        admin_key=key,
    ).start()


@contextlib.contextmanager
def as_node(database_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        yield connection


def _beat(database_url: str, node: str, address: str) -> None:
    """A heartbeat as the node writes it: on its own role, its own row, claiming seen_from."""
    with as_node(database_url) as connection:
        changed = connection.execute(
            "UPDATE directory_node SET address = %s, heartbeats = heartbeats + 1, seen_from = '10.1.2.3' "
            "WHERE name = %s",
            [address, node],
        )
        assert changed.rowcount == 1


def _errors() -> dict[str, str]:
    return {answer["node"]: answer["error"] for answer in requests_recent()["nodes"]}


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the route to a public address), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel picks a route
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address  # noqa: S104


@pytest.fixture
def pair() -> Iterator[dict[str, object]]:
    """Nodes gpu-a and gpu-b, each with its credential and an engine status server on its own key."""
    issued = {}
    servers = {}
    for name in ("gpu-a", "gpu-b"):
        node_create(name)
        issued[name] = node_credential_create(node=name)
        servers[name] = _status_server(name, issued[name].admin_key)
        _beat(issued[name].database_url, name, servers[name].address)
    yield {"issued": issued, "servers": servers}
    for server in servers.values():
        server.stop()


def test_each_node_is_read_with_its_own_key_which_opens_no_other_node(pair, settings):
    settings.STRATA_NODE_ADMIN_KEY = "fleet-wide-key"
    issued, servers = pair["issued"], pair["servers"]
    key_a, key_b = issued["gpu-a"].admin_key, issued["gpu-b"].admin_key
    assert key_a != key_b and len(key_a) == 64 and settings.STRATA_NODE_ADMIN_KEY not in (key_a, key_b)
    assert _errors() == {"gpu-a": "", "gpu-b": ""}
    # A's key on B's server (the real access check of the node's endpoints): refused.
    with as_node(issued["gpu-a"].database_url) as connection:
        connection.execute(
            "UPDATE directory_node SET address = %s, heartbeats = heartbeats + 1 WHERE name = 'gpu-a'",
            [servers["gpu-b"].address],
        )
    errors = _errors()
    assert "refused the control plane's key (401)" in errors["gpu-a"] and errors["gpu-b"] == ""


def test_rotation_changes_the_key_and_the_control_plane_uses_the_new_one(pair):
    issued, server = pair["issued"]["gpu-a"], pair["servers"]["gpu-a"]
    rotated = node_credential_rotate(node="gpu-a")
    assert rotated.admin_key != issued.admin_key
    assert "refused the control plane's key" in _errors()["gpu-a"]  # the node still runs with the old key
    server.admin_key = rotated.admin_key  # the node restarted with the rotated credential
    assert _errors()["gpu-a"] == ""


def test_a_revoked_node_is_sent_nothing(pair, recorder):
    issued = pair["issued"]["gpu-a"]
    _beat(issued.database_url, "gpu-a", f"127.0.0.1:{recorder.port}")
    node_credential_revoke(node="gpu-a")
    before = NODE_ADDRESS_REFUSED.labels(node="gpu-a")._value.get()
    error = _errors()["gpu-a"]
    assert error.startswith("not contacted: node gpu-a: its credential is revoked")
    assert recorder.seen == []
    assert NODE_ADDRESS_REFUSED.labels(node="gpu-a")._value.get() == before + 1


def test_a_node_that_reports_another_address_is_sent_nothing(pair, recorder, settings):
    here = _non_loopback_address()
    if here is None:
        pytest.skip("this machine has no non-loopback address to listen on")
    issued = pair["issued"]["gpu-a"]
    # Its heartbeat came over the unix socket, yet it claims an address on the network.
    _beat(issued.database_url, "gpu-a", f"{here}:{recorder.port}")
    error = _errors()["gpu-a"]
    assert error.startswith(f"not contacted: node gpu-a: address '{here}:{recorder.port}'")
    assert "its heartbeat came over a local socket" in error and "nothing was sent there" in error
    assert recorder.seen == []
    # The same address named by the operator is read, with the node's own key.
    settings.STRATA_NODE_ADDRESSES = allow_list_parse(f"{here}/32")
    assert _errors()["gpu-a"] == ""
    assert recorder.seen == [("/v1/strata/requests", f"Bearer {issued.admin_key}")]


@pytest.mark.parametrize(
    "address",
    ["http://127.0.0.1:{port}", "127.0.0.1:{port}/admin", "user@127.0.0.1:{port}", "127.0.0.1", "127.0.0.1:{port}?x"],
)
def test_malformed_addresses_are_refused_by_name(pair, recorder, address):
    reported = address.format(port=recorder.port)
    _beat(pair["issued"]["gpu-a"].database_url, "gpu-a", reported)
    error = _errors()["gpu-a"]
    assert error.startswith(f"not contacted: node gpu-a: address {reported!r}")
    assert recorder.seen == []


def test_a_redirect_is_not_followed(pair, recorder):
    bouncer = Recorder(status=302, location=f"http://127.0.0.1:{recorder.port}/stolen")
    try:
        _beat(pair["issued"]["gpu-a"].database_url, "gpu-a", f"127.0.0.1:{bouncer.port}")
        assert "HTTP 302" in _errors()["gpu-a"]
        assert [path for path, _ in bouncer.seen] == ["/v1/strata/requests"] and recorder.seen == []
    finally:
        bouncer.close()


def test_seen_from_is_the_databases_record_not_the_nodes(pair):
    issued = pair["issued"]["gpu-a"]
    node = Node.objects.get(name="gpu-a")
    assert node.seen_from is None  # its heartbeats came over the unix socket; it wrote 10.1.2.3
    with as_node(issued.database_url) as own:
        own.execute("UPDATE directory_node SET seen_from = '10.9.9.9' WHERE name = 'gpu-a'")
    assert Node.objects.get(name="gpu-a").seen_from is None
    # A value from before (as a TCP connection would leave it) stays through the control plane's
    # own updates, and the node's next heartbeat replaces it with where that heartbeat came from.
    with control_plane.cursor() as owner:  # the control plane's connection: the tables' owner
        owner.execute("ALTER TABLE directory_node DISABLE TRIGGER node_seen_from")
        try:
            owner.execute("UPDATE directory_node SET seen_from = '192.0.2.7' WHERE name = 'gpu-a'")
        finally:
            owner.execute("ALTER TABLE directory_node ENABLE TRIGGER node_seen_from")
        owner.execute("UPDATE directory_node SET state = 'stale', seen_from = NULL WHERE name = 'gpu-a'")
    assert Node.objects.get(name="gpu-a").seen_from == "192.0.2.7"
    _beat(issued.database_url, "gpu-a", node.address)
    assert Node.objects.get(name="gpu-a").seen_from is None


def test_the_command_prints_and_writes_the_nodes_admin_key(pair, tmp_path, capsys):
    call_command("strata_node_credential", "gpu-a", "--rotate")
    printed = capsys.readouterr().out.splitlines()
    key = next(line for line in printed if line.startswith("STRATA_NODE_ADMIN_KEY=")).split("=", 1)[1]
    assert len(key) == 64 and key != pair["issued"]["gpu-a"].admin_key
    folder = tmp_path / "credentials"
    call_command("strata_node_credential", "gpu-b", "--rotate", "--url-dir", str(folder))
    path = Path(folder / "gpu-b.admin.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    written = path.read_text().strip()
    assert len(written) == 64 and written != pair["issued"]["gpu-b"].admin_key
    pair["servers"]["gpu-b"].admin_key = written
    pair["servers"]["gpu-a"].admin_key = key
    assert _errors() == {"gpu-a": "", "gpu-b": ""}


def test_the_command_gives_a_live_credentials_key_without_changing_it(pair, tmp_path, capsys):
    issued = pair["issued"]["gpu-a"]
    call_command("strata_node_credential", "gpu-a", "--admin-key")
    assert capsys.readouterr().out.strip() == f"STRATA_NODE_ADMIN_KEY={issued.admin_key}"
    call_command("strata_node_credential", "gpu-a", "--admin-key", "--url-dir", str(tmp_path))
    assert (tmp_path / "gpu-a.admin.key").read_text().strip() == issued.admin_key
    with as_node(issued.database_url) as own:  # the password is unchanged
        assert own.execute("SELECT strata_node_name()").fetchone() == ("gpu-a",)
    node_credential_revoke(node="gpu-a")
    with pytest.raises(CommandError, match="'gpu-a': its credential was revoked; it has no admin key"):
        call_command("strata_node_credential", "gpu-a", "--admin-key")
