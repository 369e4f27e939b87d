"""The disk tier's path between block files and GPU memory through kvikio's CuFile (GPUDirect
Storage where the platform has it), present only where CUDA and kvikio both are."""

from __future__ import annotations

import errno
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
    `src` after it, the file padded to `file_bytes`. Every failure is an OSError (see
    `_kvikio_error`), a short write one too, as on the POSIX path."""
    os.pwrite(fd, host_view(header), 0)
    nbytes = src.numel() * src.element_size()
    try:
        with kvikio.CuFile(path, "r+") as cufile:
            written = int(cufile.pwrite(src, nbytes, header_bytes).get())
    except RuntimeError as exc:
        raise _kvikio_error(exc, path) from exc
    if written != nbytes:
        raise OSError(errno.EIO, f"kvikio wrote {written} of {nbytes} bytes", str(path))
    os.ftruncate(fd, file_bytes)


def _kvikio_error(exc: RuntimeError, path: Path) -> OSError:
    """kvikio's C++ errors (cuFile's, or its POSIX fallback's) reach Python as RuntimeError
    without an errno; a full filesystem or quota is told by the message (strerror's text, as
    kvikio's system errors carry it), anything else is EIO."""
    message = str(exc)
    code = next(
        (code for code in (errno.ENOSPC, errno.EDQUOT) if os.strerror(code).lower() in message.lower()), errno.EIO
    )
    return OSError(code, f"kvikio: {message}", str(path))


def kvikio_read(kvikio: Any, path: Path, dst: torch.Tensor, nbytes: int, offset: int) -> int:
    """Read `nbytes` of a block file at `offset` into GPU memory `dst`; returns the bytes read."""
    with kvikio.CuFile(path, "r") as cufile:
        return int(cufile.pread(dst, nbytes, offset).get())
