"""Nodes' own Redis identities: an ACL user per node, created, rotated and revoked beside its
PostgreSQL role (`credentials.py`), so that a node can reach only what it needs.

A node's user may:
- consume its own Celery queue `node.<name>` (and its priority lists), declare its binding, and
  keep its unacknowledged messages under keys of its own (`node.<name>.unacked*`, the transport
  options `node_broker_transport_options` gives the node's worker);
- read and write the L3 blocks and the L3 usage hash under the deployment's remote key prefix
  (`<prefix>:*`: L3 is shared by every node, and each value carries its own checksum and key);
- send the dashboard's live events (`asgi:*` and the sequence counter): its heartbeats and
  registrations are shown there; the events are display only;
- take part in Celery's remote control (its pidbox queue, the broadcast channel and replies):
  a worker on the Redis transport without it does not notice a restarted broker and stops
  consuming. A node can therefore also broadcast remote-control commands to every worker (a
  `shutdown` is a denial of service; no command moves or changes data).

It may not read or write another node's queue or the control queue (so it cannot send the
control plane's tasks: `policies.*`, `movements.*`), nor run admin or dangerous commands
(`CONFIG`, `FLUSHALL`, `FLUSHDB`, `KEYS`, `DEBUG`, `SHUTDOWN`, `ACL`, ...), nor use any other
pub/sub channel. Every queue pattern ends at a character a node name cannot hold ('.', '@' or
0x06), so node `a` cannot reach node `a2`'s queue.

Redis ACLs bind only clients that log in as the user: the deployment's default user must need a
password too (`requirepass`, or `user default off`), else any client can connect as it.
`default_user_open` says whether it does not.

User names carry the database's name, as the roles do: a test run beside the demo on one Redis
must not share a node's user.
"""

from __future__ import annotations

import re
from urllib.parse import quote

import redis
from django.conf import settings

from controlplane.directory.errors import DirectoryError

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
DASHBOARD_KEYS = ("asgi:*", "strata:dashboard:seq*")
"""The channel layer's keys (channels_redis's default prefix) and the events' sequence counter."""
PRIORITY_SEPARATOR = "\x06\x16"
"""kombu's separator between a queue's name and its priority step (`node.a\\x06\\x163`)."""


class RedisIdentityError(DirectoryError):
    field = "node"


def admin_client() -> redis.Redis:
    """The control plane's own connection to the deployment's Redis (it must be allowed `ACL`)."""
    env = settings.ENV.redis
    return redis.Redis.from_url(env.url_for_db(env.db), socket_timeout=5, socket_connect_timeout=5)


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise RedisIdentityError(
            f"remote_prefix: {prefix!r} is not a key prefix (letters, digits, '_', '.', '-'; at most 128, "
            "no glob characters)",
            field="remote_prefix",
        )
    return prefix


def node_key_patterns(node: str, remote_prefix: str) -> list[bytes]:
    """The keys node `node`'s user may touch (ACL `~` patterns, without the tilde)."""
    queue = f"node.{node}"
    patterns = [
        queue,
        f"{queue}{PRIORITY_SEPARATOR}*",
        f"{queue}.unacked*",
        f"_kombu.binding*.{queue}",  # its binding table and kombu's record that it does not expire
        f"{remote_prefix}:*",
        *DASHBOARD_KEYS,
        # Celery's remote control: the worker's own pidbox queue (its host name is `<name>@<host>`),
        # the broadcast exchange's binding tables it adds itself to, and the replies it sends.
        f"{node}@*.celery.pidbox",
        f"{node}@*.celery.pidbox{PRIORITY_SEPARATOR}*",
        "_kombu.binding*.celery.pidbox",
        "_kombu.binding_deadlines",  # the broadcast queue expires: kombu keeps its binding alive
        "_kombu.binding.reply.celery.pidbox",
        "*.reply.celery.pidbox",
    ]
    return [p.encode() for p in patterns]


def node_channel_patterns() -> list[bytes]:
    """The pub/sub channels a node's user may use: the remote-control broadcasts (kombu's fanout
    channel `/<db>.celery.pidbox`, which it subscribes to with PSUBSCRIBE: Redis lets a pattern
    through only when it is an allowed pattern as written, so the deployment's database number
    is spelled out)."""
    return [f"/{settings.ENV.redis.db}.celery.pidbox".encode()]


def node_broker_transport_options(node: str) -> dict[str, str]:
    """The node worker's own keys for its unacknowledged messages (kombu keeps them in shared
    keys by default, which a node's user may not touch)."""
    return {
        "unacked_key": f"node.{node}.unacked",
        "unacked_index_key": f"node.{node}.unacked_index",
        "unacked_mutex_key": f"node.{node}.unacked_mutex",
    }


NODE_COMMANDS = ("+@all", "-@dangerous", "-@admin", "+select", "+info")
"""Everything a client library and kombu's transport use, minus admin and dangerous commands
(pub/sub reaches only the channels `node_channel_patterns` allows). `INFO` (dangerous by
category) is let through: the node reads the eviction policy with it at start. (redis-py's
CLIENT SETINFO at connect is refused, and redis-py ignores that.)"""


def _execute(what: str, *command: object) -> object:
    try:
        with admin_client() as client:
            return client.execute_command(*command)
    except redis.exceptions.ResponseError as exc:
        raise RedisIdentityError(f"Redis refused to {what}: {exc}") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise RedisIdentityError(f"Redis is not reachable to {what}: {exc}") from exc


def _set_user(user: str, *rules: str | bytes) -> None:
    _execute(f"set up user {user!r}", "ACL", "SETUSER", user, *rules)


def redis_user_create(*, user: str, node: str, password: str, remote_prefix: str) -> None:
    """(Re)create `user` for node `node` with exactly the node's rules and this password."""
    patterns = [b"~" + pattern for pattern in node_key_patterns(node, check_prefix(remote_prefix))]
    channels = [b"&" + pattern for pattern in node_channel_patterns()]
    _set_user(user, "reset", "on", f">{password}", "resetchannels", *channels, *patterns, *NODE_COMMANDS)


def redis_user_password(*, user: str, password: str) -> None:
    """A new password for `user`; the old one stops working at once (open connections stay)."""
    _set_user(user, "resetpass", f">{password}")


def redis_user_revoke(*, user: str) -> int:
    """Turn `user` off, drop its passwords and close its connections; returns how many."""
    _set_user(user, "off", "resetpass")
    return int(_execute(f"disconnect user {user!r}", "CLIENT", "KILL", "USER", user) or 0)  # type: ignore[call-overload]


def redis_user_exists(user: str) -> bool:
    return user in {str(name, "utf-8") for name in _execute("list users", "ACL", "USERS")}  # type: ignore[attr-defined]


def default_user_open() -> bool:
    """Whether a client can connect as Redis's default user without a password."""
    try:
        with admin_client() as client:
            user = client.acl_getuser("default") or {}
    except redis.exceptions.RedisError as exc:
        raise RedisIdentityError(f"Redis refused to read the default user: {exc}") from exc
    raw = user.get("flags")
    flags = {str(flag) for flag in raw} if isinstance(raw, list) else set()
    return "on" in flags and "nopass" in flags


def node_redis_url(user: str, password: str) -> str:
    """The deployment's REDIS_URL for `user` (its database number: the deployment's)."""
    env = settings.ENV.redis
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    if env.scheme == "unix":
        return f"unix://{auth}{env.socket_path}?db={env.db}"
    base = env.url_for_db(env.db)
    scheme, rest = base.split("://", 1)
    rest = rest.rpartition("@")[2]  # the control plane's own user and password, if any, go
    return f"{scheme}://{auth}{rest}"
