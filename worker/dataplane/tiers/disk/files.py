"""The disk tier's block files: where they live, their sizes, per-thread I/O buffers and exact
reads and writes; shared by the tier's write path (`writes`) and read paths (`reads`)."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from worker.dataplane.buffers import DIRECT_IO_ALIGNMENT, aligned_empty, round_up
from worker.dataplane.checksum import Span, layer_prefix
from worker.dataplane.errors import BlockMissing
from worker.dataplane.tiers.base import Tier
from worker.dataplane.tiers.disk.folder_sync import FolderSyncer
from worker.dataplane.tiers.disk.headers import Header, HeaderCache, Stamp, parse_block_header
from worker.dataplane.tiers.disk.ledger import Ledger
from worker.dataplane.tiers.disk.names import block_path, temp_path
from worker.dataplane.tiers.disk.unlinker import Unlinker
from worker.dataplane.tiers.header import HeaderInvalid


class BlockFiles(Tier):
    """The state and file helpers the disk tier's reads and writes share (`DiskTier` sets it up)."""

    root: Path
    capacity_bytes: int
    header_bytes: int
    file_bytes: int
    direct_io: bool
    host_token: str
    _kvikio: Any | None
    _local: threading.local
    _headers: HeaderCache
    _ledger: Ledger
    _dirs: set[Path]
    _syncer: FolderSyncer
    _unlinker: Unlinker

    def path_of(self, key: uuid.UUID) -> Path:
        return block_path(self.root, key)

    def _temp_path(self, final: Path, key: uuid.UUID, reserved: int) -> Path:
        return temp_path(final, key, reserved, self.host_token)

    def _parse_header(self, key: uuid.UUID, raw: memoryview) -> Header:
        try:
            return parse_block_header(self.layout, key, raw)
        except HeaderInvalid as exc:
            raise self._corrupt(key, str(exc)) from None

    # -- per-thread buffers ---------------------------------------------------------------
    def _header_buffer(self) -> torch.Tensor:
        buffer = getattr(self._local, "header", None)
        if buffer is None:
            buffer = self._local.header = aligned_empty(self.header_bytes)
        return buffer

    def _staging(self, nbytes: int) -> torch.Tensor:
        """An aligned (pinned under CUDA) host buffer for I/O of GPU tensors, per I/O thread."""
        buffer = getattr(self._local, "staging", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._local.staging = aligned_empty(round_up(nbytes, DIRECT_IO_ALIGNMENT), pin=True)
        return buffer[:nbytes]

    # -- raw I/O --------------------------------------------------------------------------
    @staticmethod
    def _pread_exact(fd: int, views: list[memoryview], offset: int) -> int:
        """preadv until every view is full or the file ends; returns the bytes read."""
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            n = os.preadv(fd, _advance(views, done), offset + done)
            if n == 0:
                break
            done += n
        return done

    @staticmethod
    def _pwrite_exact(fd: int, views: list[memoryview], offset: int) -> None:
        want = sum(len(v) for v in views)
        done = 0
        while done < want:
            done += os.pwritev(fd, _advance(views, done), offset + done)

    def _open_for_read(self, key: uuid.UUID, *, direct: bool) -> tuple[int, Stamp]:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            self.counters.add(f"{self.name}.misses")
            raise BlockMissing(key, tier=self.name) from None
        st = os.fstat(fd)
        return fd, Stamp(inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def _spans(self, key: uuid.UUID, buffer: torch.Tensor, layers: range) -> list[Span]:
        """One span per layer of `buffer`, which holds `layers` back to back."""
        base, size = buffer.data_ptr(), self.layout.layer_bytes
        return [
            Span(src=base + j * size, nbytes=size, prefix=layer_prefix(key, layer)) for j, layer in enumerate(layers)
        ]


def _advance(views: list[memoryview], skip: int) -> list[memoryview]:
    """The views with the first `skip` bytes dropped (after a short read or write)."""
    if skip == 0:
        return views
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out
