"""Node credentials: a PostgreSQL role per node, created, rotated and revoked by the control plane.

A node's role is a member of the database's node group (`<database>_nodes`), which holds the
grants below: read what a node reads (the directory, the movements, the policies), register
blocks and count their touches, and write its own node's rows (its heartbeat, tiers, traffic,
copies, movements and tier recounts; row-level security, migration directory 0009, holds those to
the node the role is registered for). Nothing on users, sessions or tokens, no policy writes, no DDL. The
control plane (the tables' owner) runs these statements, so its role needs CREATEROLE.

Each credential also carries the node's own admin key (`node_admin_key`): the key of the node's
operator endpoints, which the control plane reads the node with. It is derived, not stored: an
HMAC under SECRET_KEY of the node's name and the time the credential was issued or last rotated,
so rotating the credential changes it, and changing SECRET_KEY changes every node's key.

Role names carry the database's name: roles belong to the whole PostgreSQL server, and two
databases on one server (a test run beside the demo) must not share a node's role.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import secrets
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from django.apps import apps
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from controlplane.directory.errors import DirectoryError, UnknownNode
from controlplane.directory.models import NodeCredential
from controlplane.directory.services import redis_identity

log = logging.getLogger("strata.directory")

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

READ_TABLES = (
    "directory.Node",
    "directory.NodeTier",
    "directory.NodeTraffic",
    "directory.Namespace",
    "directory.ModelProfile",
    "directory.Block",
    "directory.Placement",
    "movements.Movement",
    "movements.MovementTally",
    "movements.TierRecount",
    "policies.PriorityClass",
    "policies.TierPolicy",
    "policies.Mode",
    "policies.ModeSchedule",
    "policies.PolicyVersion",
    "policies.NamespaceQuota",
    "policies.LoadFollowing",
)
"""Tables a node reads (lookups, its movements, the policies in force)."""

WRITES = (
    ("directory.Node", "INSERT, UPDATE"),  # its heartbeat (row-level security: its own row)
    ("directory.NodeTier", "INSERT, UPDATE, DELETE"),
    ("directory.NodeTraffic", "INSERT, UPDATE, DELETE"),
    ("directory.Placement", "INSERT, UPDATE, DELETE"),  # its own copies and the shared remote tier's
    ("directory.Block", "INSERT"),  # registration; touches below
    ("directory.Block", "UPDATE (access_count, last_access_at)"),
    ("directory.Namespace", "INSERT"),  # the namespaces of its API keys, when missing
    ("directory.ModelProfile", "INSERT"),  # the profile of the model it serves, when missing
    ("movements.Movement", "UPDATE"),  # the movements its worker executes (row-level security)
    ("movements.MovementTally", "INSERT, UPDATE"),  # the running totals its finished movements add to
    (
        "movements.TierRecount",
        "INSERT, UPDATE",
    ),  # its reconcile's recounts (row-level security: its own, the shared tier's)
)


class CredentialError(DirectoryError):
    field = "node"


@dataclasses.dataclass(frozen=True)
class IssuedCredential:
    """A node's role and its new password, as the database URL the node starts with."""

    node: str
    role: str
    password: str
    database_url: str
    redis_url: str = ""
    """The deployment's REDIS_URL as the node's own Redis user (named as the role, same password)."""
    admin_key: str = dataclasses.field(default="", repr=False)
    """The node's own admin key (its STRATA_NODE_ADMIN_KEY), `node_admin_key` of this credential."""


ADMIN_KEY_SALT = "strata.node-admin-key"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def node_admin_key(credential: NodeCredential) -> str:
    """Node `credential.node`'s own admin key, hex: an HMAC (key salt ADMIN_KEY_SALT, secret
    SECRET_KEY) of the node's name and the microsecond its credential was issued or last rotated.
    The same on every control plane process of one deployment; no other node's key follows from it."""
    issued = credential.rotated_at or credential.created_at
    micros = (issued - _EPOCH) // timedelta(microseconds=1)
    value = f"{credential.node}:{micros}"
    return salted_hmac(ADMIN_KEY_SALT, value, secret=settings.SECRET_KEY, algorithm="sha256").hexdigest()


def _ident(name: str) -> str:
    return connection.ops.quote_name(name)


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _role_name(database: str, suffix: str) -> str:
    """`<database>_<suffix>` folded to a PostgreSQL identifier of at most 63 bytes."""
    name = re.sub(r"[^a-z0-9_]", "_", f"{database}_{suffix}".lower())
    if len(name) > 63:
        name = f"{name[:46]}_{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return name


def group_role() -> str:
    """The group role every node role of this database belongs to."""
    return _role_name(connection.settings_dict["NAME"], "nodes")


def node_role(node: str) -> str:
    return _role_name(connection.settings_dict["NAME"], f"node_{node}")


def _check_name(node: str) -> str:
    if not isinstance(node, str) or not _NAME.match(node):
        raise CredentialError(
            f"node: {node!r} is not a node name (lowercase letters, digits and hyphens, at most 63)", field="node"
        )
    return node


def _role_exists(cursor, role: str) -> bool:  # type: ignore[no-untyped-def]
    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
    return cursor.fetchone() is not None


def node_grants_apply() -> str:
    """Create the node group role if missing and give it the node's grants (idempotent: run at
    every credential change, so tables added since are covered). Returns the group's name."""
    group = group_role()
    with connection.cursor() as cursor:
        if not _role_exists(cursor, group):
            cursor.execute(f"CREATE ROLE {_ident(group)} NOLOGIN")
        cursor.execute(f"GRANT CONNECT ON DATABASE {_ident(connection.settings_dict['NAME'])} TO {_ident(group)}")
        cursor.execute("SELECT current_schema()")
        schema = cursor.fetchone()[0]
        cursor.execute(f"GRANT USAGE ON SCHEMA {_ident(schema)} TO {_ident(group)}")
        for label in READ_TABLES:
            cursor.execute(f"GRANT SELECT ON {_ident(apps.get_model(label)._meta.db_table)} TO {_ident(group)}")
        for label, privileges in WRITES:
            cursor.execute(f"GRANT {privileges} ON {_ident(apps.get_model(label)._meta.db_table)} TO {_ident(group)}")
    return group


def database_url(role: str, password: str) -> str:
    """The URL of this database for `role` (unix socket hosts as ?host=)."""
    params = connection.settings_dict
    user = f"{quote(role, safe='')}:{quote(password, safe='')}"
    host, port, name = params["HOST"] or "", params["PORT"] or "", quote(params["NAME"], safe="")
    if host.startswith("/") or not host:
        return f"postgresql://{user}@/{name}" + (f"?host={quote(host, safe='/')}" if host else "")
    return f"postgresql://{user}@{host}:{port or 5432}/{name}"


@transaction.atomic
def node_credential_create(*, node: str, remote_prefix: str = "strata") -> IssuedCredential:
    """Give node `node` its own role (LOGIN, a new random password, a member of the node group)
    and its own Redis user (`redis_identity`: its queue, the L3 keys under `remote_prefix`, the
    dashboard's events), and record it; a node that has them already gets a new password (the
    old one stops working)."""
    node = _check_name(node)
    redis_identity.check_prefix(remote_prefix)
    group = node_grants_apply()
    role = node_role(node)
    password = secrets.token_urlsafe(24)
    now = timezone.now()
    with connection.cursor() as cursor:
        verb = "ALTER" if _role_exists(cursor, role) else "CREATE"
        cursor.execute(
            f"{verb} ROLE {_ident(role)} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS INHERIT "
            f"PASSWORD {_literal(password)}"
        )
        cursor.execute(f"GRANT {_ident(group)} TO {_ident(role)}")
    credential, _ = NodeCredential.objects.update_or_create(
        node=node, defaults={"role": role, "created_at": now, "rotated_at": None, "revoked_at": None}
    )
    # Last: a Redis that refuses rolls the role back with the transaction.
    redis_identity.redis_user_create(user=role, node=node, password=password, remote_prefix=remote_prefix)
    log.info("node %s: credential %s issued (PostgreSQL role and Redis user)", node, role)
    return IssuedCredential(
        node=node,
        role=role,
        password=password,
        database_url=database_url(role, password),
        redis_url=redis_identity.node_redis_url(role, password),
        admin_key=node_admin_key(credential),
    )


@transaction.atomic
def node_credential_rotate(*, node: str) -> IssuedCredential:
    """A new password for node `node`'s role, and a new admin key (the old one stops opening the
    node's operator endpoints once the node runs with the new one); sessions already open stay
    until they reconnect."""
    credential = _credential(node)
    if credential.revoked_at is not None:
        raise CredentialError(f"node {node!r}: its credential was revoked; create a new one", field="node")
    password = secrets.token_urlsafe(24)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER ROLE {_ident(credential.role)} PASSWORD {_literal(password)}")
    credential.rotated_at = timezone.now()
    credential.save(update_fields=["rotated_at"])
    redis_identity.redis_user_password(user=credential.role, password=password)
    log.info("node %s: credential %s rotated", node, credential.role)
    return IssuedCredential(
        node=node,
        role=credential.role,
        password=password,
        database_url=database_url(credential.role, password),
        redis_url=redis_identity.node_redis_url(credential.role, password),
        admin_key=node_admin_key(credential),
    )


@transaction.atomic
def node_credential_revoke(*, node: str) -> int:
    """Take node `node`'s login away and end its open sessions; the row stays, marked revoked, and
    the control plane sends that node nothing from then on (no key). Returns the number of
    sessions ended."""
    credential = _credential(node)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER ROLE {_ident(credential.role)} NOLOGIN PASSWORD NULL")
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = %s", [credential.role]
        )
        ended = int(cursor.fetchone()[0])
    credential.revoked_at = timezone.now()
    credential.save(update_fields=["revoked_at"])
    ended += redis_identity.redis_user_revoke(user=credential.role)
    log.info("node %s: credential %s revoked, %d session(s) ended", node, credential.role, ended)
    return ended


def node_admin_key_current(*, node: str) -> str:
    """Node `node`'s admin key as its live credential gives it (nothing changes); an error when
    it has no credential or a revoked one."""
    credential = _credential(node)
    if credential.revoked_at is not None:
        raise CredentialError(f"node {node!r}: its credential was revoked; it has no admin key", field="node")
    return node_admin_key(credential)


def _credential(node: str) -> NodeCredential:
    _check_name(node)
    credential = NodeCredential.objects.filter(node=node).first()
    if credential is None:
        raise UnknownNode(f"node {node!r} has no credential (create one first)")
    return credential


def credential_too_strong() -> str:
    """Why the connected role must not run a node ('' when it may): a superuser, a role that
    bypasses row-level security, or one that owns (or is a member of the owner of) the directory
    tables could rewrite the whole fleet."""
    table = apps.get_model("directory.Placement")._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(session_user, c.relowner, 'USAGE') "
            "FROM pg_roles r, pg_class c WHERE r.rolname = session_user AND c.oid = %s::regclass",
            [table],
        )
        row = cursor.fetchone()
    if row is None:
        return ""
    superuser, bypass, owner = row
    user = connection.settings_dict["USER"] or "(default)"
    if superuser:
        return f"the database user {user!r} is a superuser"
    if bypass:
        return f"the database user {user!r} bypasses row-level security"
    if owner:
        return f"the database user {user!r} owns the directory's tables"
    return ""
