"""The boundary of a node's own credential, against the real PostgreSQL: node A (its role from
`strata_node_credential`) reads the directory and writes its own rows, and every attempt on node
B's rows, the policies, the accounts or the schema fails; a revoked or rotated-away password
stops at the next connection; `strata_node` refuses the control plane's own credential."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.directory.models import Block, NodeCredential, Placement
from controlplane.directory.services.credentials import (
    credential_too_strong,
    node_credential_create,
    node_credential_revoke,
    node_credential_rotate,
)
from controlplane.movements.models import Movement, TierRecount
from tests.directory.conftest import node_create

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[2]
RECOUNT_UPSERT = (
    "INSERT INTO movements_tierrecount AS t (node, tier, drift_bytes, drift_blocks, corrections, corrected_bytes, "
    "recounted_at) VALUES (%s, %s, 1, 1, 1, 1, now()) ON CONFLICT (node, tier) DO UPDATE SET "
    "corrections = t.corrections + EXCLUDED.corrections"
)


@pytest.fixture
def fleet(namespace, profile):  # type: ignore[no-untyped-def]
    """Nodes gpu-a (whose credential the test uses) and gpu-b, one host copy and one movement each."""
    now = timezone.now()
    rows = {}
    for name in ("gpu-a", "gpu-b"):
        node = node_create(name)
        block = Block.objects.create(
            namespace=namespace,
            model=profile,
            prefix_key=uuid.uuid4(),
            content_key=uuid.uuid4(),
            position=0,
            token_count=16,
            size_bytes=profile.block_bytes,
            created_at=now,
            last_access_at=now,
        )
        copy = Placement.objects.create(
            block=block, tier="host", node=node, size_bytes=profile.block_bytes, state="ready", updated_at=now
        )
        movement = Movement.objects.create(
            plan=uuid.uuid4(),
            block=block,
            kind="move",
            reason="manual",
            state="dispatched",
            src_placement_id=copy.id,
            src_epoch=copy.epoch,
            src_tier="host",
            src_node=name,
            dst_tier="disk",
            dst_node=name,
            exec_node=name,
            created_at=now,
        )
        rows[name] = (node, block, copy, movement)
    return rows


@pytest.fixture
def as_node_a(fleet) -> Iterator[psycopg.Connection]:  # type: ignore[no-untyped-def]
    issued = node_credential_create(node="gpu-a")
    with psycopg.connect(issued.database_url, autocommit=True) as connection:
        yield connection


def _fails(connection: psycopg.Connection, sql: str, params: object = None, *, match: str) -> None:
    with pytest.raises(psycopg.Error, match=match):
        connection.execute(sql, params)


def test_a_node_reads_the_directory_and_writes_its_own_rows(fleet, as_node_a):
    assert as_node_a.execute("SELECT strata_node_name()").fetchone() == ("gpu-a",)
    copies = as_node_a.execute("SELECT count(*) FROM directory_placement").fetchone()
    assert copies == (2,)  # lookups see every node's copies
    _, _, own_copy, own_move = fleet["gpu-a"]
    flipped = as_node_a.execute(
        "UPDATE directory_placement SET state = 'deleting', epoch = epoch + 1 WHERE id = %s", [own_copy.id]
    )
    assert flipped.rowcount == 1
    started = as_node_a.execute("UPDATE movements_movement SET state = 'running' WHERE id = %s", [own_move.id])
    assert started.rowcount == 1
    beat = as_node_a.execute("UPDATE directory_node SET heartbeats = heartbeats + 1 WHERE name = 'gpu-a'")
    assert beat.rowcount == 1
    touched = as_node_a.execute("UPDATE directory_block SET access_count = access_count + 1")
    assert touched.rowcount == 2  # touches count on any block: blocks are the fleet's
    for node, tier in (("gpu-a", "disk"), ("", "remote")):  # its recounts, and the shared tier's
        for _ in range(2):  # recorded, then counted again on the row (tier_recount_record's upsert)
            recorded = as_node_a.execute(RECOUNT_UPSERT, [node, tier])
            assert recorded.rowcount == 1
    assert as_node_a.execute("SELECT sum(corrections) FROM movements_tierrecount").fetchone() == (4,)


def test_node_a_cannot_touch_node_b_or_anything_of_the_control_plane(fleet, as_node_a):
    b_node, b_block, b_copy, b_move = fleet["gpu-b"]
    # Node B's rows are invisible to A's writes: nothing changes.
    assert (
        as_node_a.execute("UPDATE directory_placement SET state = 'corrupt' WHERE id = %s", [b_copy.id]).rowcount == 0
    )
    assert as_node_a.execute("DELETE FROM directory_placement WHERE id = %s", [b_copy.id]).rowcount == 0
    assert as_node_a.execute("UPDATE movements_movement SET state = 'done' WHERE id = %s", [b_move.id]).rowcount == 0
    assert as_node_a.execute("UPDATE directory_node SET state = 'down' WHERE name = 'gpu-b'").rowcount == 0
    assert (
        as_node_a.execute("UPDATE directory_nodetier SET used_bytes = 0 WHERE node_id = %s", [b_node.id]).rowcount == 0
    )
    TierRecount.objects.create(node="gpu-b", tier="disk", drift_bytes=0, drift_blocks=0, recounted_at=timezone.now())
    assert as_node_a.execute("UPDATE movements_tierrecount SET corrections = 9 WHERE node = 'gpu-b'").rowcount == 0
    _fails(as_node_a, RECOUNT_UPSERT, ["gpu-b", "host"], match="row-level security")
    # Claiming B's identity in a new row is refused by the policy.
    _fails(
        as_node_a,
        'INSERT INTO directory_placement (block_id, tier, node_id, locator, "offset", size_bytes, checksum, '
        "state, epoch, updated_at) VALUES (%s, 'disk', %s, '', 0, 1, '', 'ready', 1, now())",
        [b_block.id, b_node.id],
        match="row-level security",
    )
    _fails(
        as_node_a,
        "UPDATE directory_placement SET node_id = %s WHERE id = %s",
        [b_node.id, fleet["gpu-a"][2].id],
        match="row-level security",
    )
    _fails(
        as_node_a,
        'INSERT INTO directory_node (name, host, address, engine, engine_address, "group", state, heartbeat_seconds,'
        " heartbeats, registered_at, last_seen, stale_after) VALUES ('gpu-z', 'h', '', 'strata', '', 'default', 'up',"
        " 5, 0, now(), now(), now())",
        match="row-level security",
    )
    # No grant at all: policies, accounts, sessions, tokens, the credentials, deletes of nodes and blocks.
    _fails(as_node_a, "UPDATE policies_priorityclass SET device_share = 1", match="permission denied")
    _fails(
        as_node_a,
        "INSERT INTO policies_policyversion (number, snapshot, action, author, comment, created_at) "
        "VALUES (999, '{}', 'x', '', '', now())",
        match="permission denied",
    )
    _fails(as_node_a, "SELECT * FROM auth_user", match="permission denied")
    _fails(as_node_a, "SELECT * FROM authtoken_token", match="permission denied")
    _fails(as_node_a, "SELECT * FROM django_session", match="permission denied")
    _fails(as_node_a, "SELECT * FROM directory_nodecredential", match="permission denied")
    _fails(as_node_a, "DELETE FROM directory_node WHERE name = 'gpu-b'", match="permission denied")
    _fails(as_node_a, "DELETE FROM directory_block", match="permission denied")
    _fails(as_node_a, "UPDATE directory_block SET priority = 'gold'", match="permission denied")
    # No DDL.
    _fails(as_node_a, "CREATE TABLE stolen (x int)", match="permission denied")
    _fails(as_node_a, "ALTER TABLE directory_placement DISABLE ROW LEVEL SECURITY", match="must be owner")
    _fails(as_node_a, "DROP POLICY placement_own ON directory_placement", match="must be owner")
    b_copy.refresh_from_db()
    b_move.refresh_from_db()
    assert (b_copy.state, b_move.state) == ("ready", "dispatched")


def test_a_revoked_credential_fails_at_the_next_connection(fleet):
    issued = node_credential_create(node="gpu-a")
    with psycopg.connect(issued.database_url, autocommit=True) as connection:
        assert connection.execute("SELECT 1").fetchone() == (1,)
        node_credential_revoke(node="gpu-a")
        with pytest.raises(psycopg.OperationalError):  # its open session was ended
            connection.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="not permitted to log in|password authentication failed"):
        psycopg.connect(issued.database_url)
    assert NodeCredential.objects.get(node="gpu-a").revoked_at is not None
    with pytest.raises(CommandError, match="was revoked; create a new one"):
        call_command("strata_node_credential", "gpu-a", "--rotate")
    again = node_credential_create(node="gpu-a")  # a new credential for the same node works
    with psycopg.connect(again.database_url) as connection:
        assert connection.execute("SELECT strata_node_name()").fetchone() == ("gpu-a",)


def test_a_rotated_password_replaces_the_old_one(fleet):
    first = node_credential_create(node="gpu-a")
    wrong = first.database_url.replace(first.password, "not-the-password")
    try:
        psycopg.connect(wrong).close()
    except psycopg.OperationalError:
        pass
    else:
        pytest.skip("this PostgreSQL trusts every password (DATABASE_URL's server); the embedded one checks them")
    second = node_credential_rotate(node="gpu-a")
    assert second.password != first.password and second.role == first.role
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(first.database_url)
    with psycopg.connect(second.database_url) as connection:
        assert connection.execute("SELECT strata_node_name()").fetchone() == ("gpu-a",)


def test_bad_names_and_unknown_nodes_are_refused_by_name():
    with pytest.raises(CommandError, match="'GPU_A' is not a node name"):
        call_command("strata_node_credential", "GPU_A")
    with pytest.raises(CommandError, match="node 'gpu-q' has no credential"):
        call_command("strata_node_credential", "gpu-q", "--revoke")
    assert NodeCredential.objects.count() == 0


def test_strata_node_refuses_the_control_planes_credential(subprocess_env, python):
    problem = credential_too_strong()
    assert problem  # the test database's user is the tables' owner
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-a"],
        cwd=REPO_ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"strata_node: {problem}: a node runs on its own credential")
    assert "--allow-owner-credential" in last
