"""fsyncs of the folders the disk tier renames block files into (what makes a rename durable), gathered
in the background. The filesystem calls these directories; the module is named apart from the block
directory, which it has nothing to do with."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from worker.dataplane.counters import Counters
from worker.dataplane.errors import TierUnavailable

log = logging.getLogger(__name__)

_NO_FOLDER_SYNC_ERRNOS = {errno.EINVAL, errno.EOPNOTSUPP}
"""fsync of a directory refused this way means the filesystem does not sync directories (some
FUSE and network filesystems); the rename is then as durable as that filesystem makes it."""
FOLDER_SYNC_DELAY_S = 0.05
"""A rename is made durable (its directory fsynced) at most this long after it, in the background.
A directory fsync is a journal commit and a device cache flush: synced inside every `put` it
would cost a large share of a block's write time (benchmarks/README.md); gathered, one flush
covers the puts of this window. A put that
returned is complete under its name at once; until its directory is synced a crash of the
machine may lose the name (the block is then a miss, and the reconciler marks its placement
missing), which is why a movement calls `sync()` before it flips a copy to READY."""


def sync_folder(directory: Path) -> None:
    """fsync `directory`, making the names just created or renamed in it durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_FOLDER_SYNC_ERRNOS:
            raise
    finally:
        os.close(fd)


class FolderSyncer:
    """fsyncs the directories blocks were renamed into: in the background, FOLDER_SYNC_DELAY_S
    after the first rename of a quiet spell, or at once in `sync`. One pass at a time, so `sync`
    returns only once every rename before it, including those a background pass was syncing,
    is durable."""

    def __init__(self, sync_one: Callable[[Path], None], *, tier: str, counters: Counters) -> None:
        self._sync_one = sync_one
        self._tier = tier
        self._counters = counters
        self._dirty: set[Path] = set()
        self._wake = threading.Condition()
        self._pass_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failing: set[Path] = set()  # logged once per failing streak, not every pass

    def add(self, directories: Iterable[Path]) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError(f"the {self._tier} tier is closed")
            self._dirty.update(directories)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"strata-{self._tier}-dirsync", daemon=True)
                self._thread.start()
            self._wake.notify()

    def sync(self) -> None:
        """Make every rename so far durable; raises the first directory's failure (the failed
        directories stay to be synced again)."""
        errors = self._pass()
        if errors:
            directory, exc = errors[0]
            raise TierUnavailable(
                self._tier,
                reason=f"syncing the directory {directory} failed: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror or exc})",
            ) from exc

    def close(self) -> None:
        """A last pass, then stop the background thread (failures are logged)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self._pass()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._dirty and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return  # close() makes the last pass
            time.sleep(FOLDER_SYNC_DELAY_S)  # let the renames of this spell gather
            self._pass()

    def _pass(self) -> list[tuple[Path, OSError]]:
        with self._pass_lock:
            with self._wake:
                directories, self._dirty = self._dirty, set()
            errors: list[tuple[Path, OSError]] = []
            for directory in sorted(directories):
                try:
                    self._sync_one(directory)
                except FileNotFoundError:
                    continue  # removed meanwhile (a cleared tier): nothing in it to keep
                except OSError as exc:
                    errors.append((directory, exc))
                    continue
                self._failing.discard(directory)
            if errors:
                self._counters.add(f"{self._tier}.directory_sync_failures", len(errors))
                with self._wake:
                    self._dirty.update(directory for directory, _ in errors)
                for directory, error in errors:
                    if directory not in self._failing:
                        self._failing.add(directory)
                        log.error(
                            "%s tier: syncing the directory %s failed (%s); blocks renamed into it "
                            "may not survive a crash of this machine, retrying",
                            self._tier,
                            directory,
                            error,
                        )
            return errors
