"""Nodes' own credentials: `manage.py strata_node_credential NODE [NODE ...]` creates each node's
PostgreSQL role and Redis user (or gives them a new password), `--rotate` changes the password,
`--revoke` takes the login away and ends the node's sessions and connections.

Create and rotate print each node's DATABASE_URL, REDIS_URL and its own STRATA_NODE_ADMIN_KEY
(the key of its operator endpoints, which the control plane reads it with) once (the password is
kept nowhere else): start the node with them, `DATABASE_URL=... REDIS_URL=...
STRATA_NODE_ADMIN_KEY=... manage.py strata_node --name NODE`. With `--url-dir DIR` they go to
DIR/NODE.url, DIR/NODE.redis.url and DIR/NODE.admin.key (mode 0600) instead, for the node's
DATABASE_URL_FILE, REDIS_URL_FILE and STRATA_NODE_ADMIN_KEY_FILE. Rotation issues a new key too;
after `--revoke` the control plane sends the node nothing. `--admin-key` prints (or writes) the
admin key of each node's live credential and changes nothing: for a node whose key file is
missing, such as one issued before nodes had their own keys. `--remote-prefix` is the L3 key prefix the
node's Redis user may use (the node's STRATA_REMOTE_PREFIX; default `strata`)."""

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane.directory.errors import DirectoryError
from controlplane.directory.services import redis_identity
from controlplane.directory.services.credentials import (
    node_admin_key_current,
    node_credential_create,
    node_credential_revoke,
    node_credential_rotate,
)


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("nodes", nargs="+", help="node names (as strata_node --name)")
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--rotate", action="store_true", help="a new password for each node's role")
        action.add_argument("--revoke", action="store_true", help="take each node's login away, end its sessions")
        action.add_argument(
            "--admin-key", action="store_true", help="only each node's current admin key (changes nothing)"
        )
        parser.add_argument(
            "--url-dir",
            help="write each node's DATABASE_URL, REDIS_URL and admin key to DIR/NODE.url, DIR/NODE.redis.url and "
            "DIR/NODE.admin.key (0600)",
        )
        parser.add_argument(
            "--remote-prefix", default="strata", help="the L3 key prefix the node may use (its STRATA_REMOTE_PREFIX)"
        )

    def handle(
        self,
        *args: Any,
        nodes: list[str],
        rotate: bool,
        revoke: bool,
        admin_key: bool,
        url_dir: str | None,
        remote_prefix: str,
        **options: Any,
    ) -> None:
        for node in nodes:
            try:
                if admin_key:
                    self._admin_key(node, node_admin_key_current(node=node), url_dir)
                    continue
                if revoke:
                    ended = node_credential_revoke(node=node)
                    self.stdout.write(f"node {node}: credential revoked ({ended} open session(s) ended)")
                    continue
                issued = (
                    node_credential_rotate(node=node)
                    if rotate
                    else node_credential_create(node=node, remote_prefix=remote_prefix)
                )
            except DirectoryError as exc:
                raise CommandError(str(exc)) from exc
            if url_dir:
                folder = Path(url_dir)
                path, redis_path, key_path = (
                    folder / f"{node}{suffix}" for suffix in (".url", ".redis.url", ".admin.key")
                )
                _write_secret(path, issued.database_url)
                _write_secret(redis_path, issued.redis_url)
                _write_secret(key_path, issued.admin_key)
                self.stdout.write(
                    f"node {node}: role and Redis user {issued.role}; its DATABASE_URL is in {path}, "
                    f"its REDIS_URL in {redis_path}, its STRATA_NODE_ADMIN_KEY in {key_path}"
                )
            else:
                self.stdout.write(f"node {node}: role and Redis user {issued.role}")
                self.stdout.write(f"DATABASE_URL={issued.database_url}")
                self.stdout.write(f"REDIS_URL={issued.redis_url}")
                self.stdout.write(f"STRATA_NODE_ADMIN_KEY={issued.admin_key}")
        if not revoke and redis_identity.default_user_open():
            self.stderr.write(
                "warning: Redis's default user needs no password, so any client can still connect as it and "
                "reach every key: set requirepass (or `user default off`) for the node users to hold"
            )

    def _admin_key(self, node: str, key: str, url_dir: str | None) -> None:
        if url_dir:
            path = Path(url_dir) / f"{node}.admin.key"
            _write_secret(path, key)
            self.stdout.write(f"node {node}: its STRATA_NODE_ADMIN_KEY is in {path}")
        else:
            self.stdout.write(f"STRATA_NODE_ADMIN_KEY={key}")


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")
    os.chmod(path, 0o600)
