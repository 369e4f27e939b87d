"""The disk tier's capacity ledger: stored bytes, pending bytes and blocks of a directory, in one
small file every process using the directory updates under an exclusive flock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

LEDGER_NAME = ".strata-ledger"
_LEDGER = struct.Struct("<QQQ")  # stored bytes, pending bytes, blocks


class Ledger:
    """Stored/pending bytes and block count of a directory, shared by processes via flock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[int]]:
        """Yields [stored, pending, blocks]; changes are written back on exit."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _LEDGER.size, 0)
                state = list(_LEDGER.unpack(raw)) if len(raw) == _LEDGER.size else [0, 0, 0]
                before = list(state)
                yield state
                if state != before:
                    os.pwrite(self._fd, _LEDGER.pack(*(max(0, v) for v in state)), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
