"""Names of the disk tier's files: a block's file, a writer's temporary file and the host token in it."""

from __future__ import annotations

import os
import re
import secrets
import socket
import uuid
from pathlib import Path
from typing import NamedTuple

FOREIGN_TEMP_GRACE_SECONDS = 3600
"""A temporary file of another host (a shared mount) is removed by `reconcile` only once it has
not been modified for this long. Its writer's pid cannot be checked from here, and removing a
live write would fail it and zero its reservation; a block write takes seconds, and an hour
also covers clock skew between the hosts and the file server (the age is the file's mtime
against this host's clock)."""
HOST_TOKEN_CHARS = 63


def host_token(name: str | None = None) -> str:
    """This host's name (`socket.gethostname()`, or `name`) as it appears in temporary file names:
    runs of characters other than ASCII letters, digits, '_' and '-' become one '-' (a dot would
    split the name's fields), at most HOST_TOKEN_CHARS of them. Hosts sharing a directory must
    have names that stay distinct this way."""
    raw = socket.gethostname() if name is None else name
    token = re.sub(r"[^A-Za-z0-9_-]+", "-", raw).strip("-")[:HOST_TOKEN_CHARS]
    return token or "unnamed-host"


def block_path(root: Path, key: uuid.UUID) -> Path:
    """The file of the block `key` under the tier's directory `root`: `<2 hex>/<key hex>.blk`."""
    return root / key.hex[:2] / f"{key.hex}.blk"


def temp_path(final: Path, key: uuid.UUID, reserved: int, host: str) -> Path:
    """A temporary name of this process beside `final`, reserving `reserved` bytes: the
    reconciler of any host sharing the directory reads these fields (parse_temp_name)."""
    return final.parent / f".{key.hex}.{os.getpid()}.{secrets.token_hex(4)}.{reserved}.{host}.tmp"


class TempName(NamedTuple):
    """The fields of a temporary file's name."""

    host: str | None
    """None in names written before the host was recorded: those are this host's."""
    pid: int
    reserved: int


def parse_temp_name(name: str) -> TempName | None:
    """`.<key hex>.<pid>.<token>.<reserved bytes>.<host>.tmp`, or the same without `.<host>`;
    None for any other name."""
    parts = name.split(".")
    if len(parts) not in (6, 7) or parts[0] or parts[-1] != "tmp":
        return None
    try:
        pid, reserved = int(parts[2]), int(parts[4])
    except ValueError:
        return None
    return TempName(host=parts[5] if len(parts) == 7 else None, pid=pid, reserved=reserved)
