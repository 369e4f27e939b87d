"""How much /dev/shm a node's host pool needs, and the size notations of the deployment files.

The pool file holds the blocks, then per slot a metadata record, a free-stack entry and key
index buckets (worker/dataplane/tiers/host/pool_layout.py): under POOL_METADATA_SHARE of the pool
for blocks of MIN_BLOCK_BYTES or more (test_sizing.py measures it on a real pool). The engine
uses /dev/shm too (PyTorch's and NCCL's shared memory): ENGINE_SHM_BYTES beside the pool."""

from __future__ import annotations

import re

from worker.dataplane.config_values import parse_size

GIB = 1024**3
POOL_METADATA_SHARE = 0.02
MIN_BLOCK_BYTES = 1024**2
ENGINE_SHM_BYTES = 1 * GIB


def shm_bytes_needed(host_bytes: int) -> int:
    """/dev/shm a node with a `host_bytes` pool needs at least."""
    return int(host_bytes * (1 + POOL_METADATA_SHARE)) + ENGINE_SHM_BYTES


def strata_size(text: str) -> int:
    """A STRATA_*_BYTES value, read as the node reads it."""
    return parse_size(text)


def compose_size_at_least(text: str) -> int:
    """The smaller reading of a compose byte value (e.g. shm_size "64gb"): its units are powers of
    1024 to Docker; taken as powers of 1000 here, so a check that passes holds either way."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", str(text).strip().lower())
    assert match, f"not a compose byte value: {text!r}"
    number, unit = match.groups()
    return int(float(number) * 1000 ** "bkmg".index(unit or "b"))


_QUANTITY = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def kubernetes_quantity(text: str) -> int:
    """Bytes of a Kubernetes memory quantity such as 64Gi or 500M."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGT]i?|Ki)?", str(text).strip())
    assert match, f"not a Kubernetes quantity: {text!r}"
    number, unit = match.groups()
    return int(float(number) * _QUANTITY[unit or ""])
