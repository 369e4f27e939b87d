"""Byte buffers for zero-copy I/O: aligned tensors, raw views of tensor memory, buffer addresses."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

DIRECT_IO_ALIGNMENT = 4096
"""O_DIRECT needs buffer addresses, file offsets and lengths aligned to the device's logical
block size; 4096 covers every NVMe/SSD/virtio device we target (512 would not cover 4Kn disks)."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def aligned_empty(
    nbytes: int,
    *,
    alignment: int = DIRECT_IO_ALIGNMENT,
    device: torch.device | str | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """An uninitialised 1-D uint8 tensor whose first byte sits on an `alignment` boundary.

    CPU tensors are over-allocated and sliced (the view keeps the allocation alive), because
    torch only guarantees 64-byte alignment. `pin` page-locks the memory where CUDA exists so
    host-to-device copies can run asynchronously; it is ignored without CUDA."""
    if nbytes < 0:
        raise ValueError(f"nbytes cannot be negative, got {nbytes}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cpu":
        # CUDA allocations are at least 256-byte aligned, which is what cuFile and copies need.
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin and cuda_available())
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (no copy); refuses non-contiguous tensors."""
    if not tensor.is_contiguous():
        raise ValueError("a block buffer must be contiguous (a copy would hide an extra memcpy)")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def address_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview over raw memory; the caller keeps the owner alive while it is used."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def host_view(tensor: torch.Tensor) -> memoryview:
    """A memoryview over a CPU tensor's bytes (no copy), for os.preadv/os.pwritev and hashing."""
    if tensor.device.type != "cpu":
        raise ValueError("host_view needs a CPU tensor")
    data = tensor_bytes(tensor)
    return address_view(data.data_ptr(), data.numel())


def buffer_address(buffer: Any) -> int:
    """Address of the first byte of any object exporting the buffer protocol (bytes, mmap, ...)."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data) if array.size else 0


def is_aligned(*values: int, alignment: int = DIRECT_IO_ALIGNMENT) -> bool:
    return all(value % alignment == 0 for value in values)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def runs(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first value, its index in `values`, count) of each run of consecutive integers: one copy
    per run of consecutive blocks or pages, not one per item."""
    found: list[tuple[int, int, int]] = []
    for index, value in enumerate(values):
        if found and found[-1][0] + found[-1][2] == value:
            first, at, count = found[-1]
            found[-1] = (first, at, count + 1)
        else:
            found.append((value, index, 1))
    return found
