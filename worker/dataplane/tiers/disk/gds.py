"""The disk tier's path between block files and GPU memory through kvikio's CuFile (GPUDirect
Storage where the platform has it), present only where CUDA and kvikio both are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from worker.dataplane.buffers import cuda_available, host_view


def load_kvikio() -> Any | None:
    """kvikio's module where CUDA and kvikio are both present, else None."""
    if not cuda_available():
        return None
    try:
        import kvikio  # noqa: PLC0415 - optional GPU extra, imported only where it can work
    except ImportError:
        return None
    return kvikio


def kvikio_write(
    kvikio: Any, fd: int, path: Path, header: torch.Tensor, src: torch.Tensor, *, header_bytes: int, file_bytes: int
) -> None:
    """Write a block file from GPU memory: the header from host memory at 0, the block from
    `src` after it, the file padded to `file_bytes`."""
    os.pwrite(fd, host_view(header), 0)
    with kvikio.CuFile(path, "r+") as cufile:
        cufile.pwrite(src, src.numel(), header_bytes).get()
    os.ftruncate(fd, file_bytes)


def kvikio_read(kvikio: Any, path: Path, dst: torch.Tensor, nbytes: int, offset: int) -> int:
    """Read `nbytes` of a block file at `offset` into GPU memory `dst`; returns the bytes read."""
    with kvikio.CuFile(path, "r") as cufile:
        return int(cufile.pread(dst, nbytes, offset).get())
