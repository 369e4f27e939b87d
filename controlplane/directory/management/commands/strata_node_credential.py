"""Nodes' own database credentials: `manage.py strata_node_credential NODE [NODE ...]` creates each
node's role (or gives it a new password), `--rotate` changes its password, `--revoke` takes its
login away and ends its sessions.

Create and rotate print each node's DATABASE_URL once (the password is kept nowhere else): start
the node with it, `DATABASE_URL=... manage.py strata_node --name NODE`. With `--url-dir DIR` each
URL goes to DIR/NODE.url (mode 0600) instead, for the node's DATABASE_URL_FILE."""

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane.directory.errors import DirectoryError
from controlplane.directory.services.credentials import (
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
        parser.add_argument("--url-dir", help="write each node's DATABASE_URL to DIR/NODE.url (0600), not the terminal")

    def handle(
        self, *args: Any, nodes: list[str], rotate: bool, revoke: bool, url_dir: str | None, **options: Any
    ) -> None:
        for node in nodes:
            try:
                if revoke:
                    ended = node_credential_revoke(node=node)
                    self.stdout.write(f"node {node}: credential revoked ({ended} open session(s) ended)")
                    continue
                issued = node_credential_rotate(node=node) if rotate else node_credential_create(node=node)
            except DirectoryError as exc:
                raise CommandError(str(exc)) from exc
            if url_dir:
                path = Path(url_dir) / f"{node}.url"
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(issued.database_url + "\n")
                os.chmod(path, 0o600)
                self.stdout.write(f"node {node}: role {issued.role}; its DATABASE_URL is in {path}")
            else:
                self.stdout.write(f"node {node}: role {issued.role}")
                self.stdout.write(f"DATABASE_URL={issued.database_url}")
