"""The block header the disk and remote tiers store in front of a block's bytes, and its checks."""

from __future__ import annotations

import struct
import uuid

import xxhash

from worker.dataplane.checksum import CHECKSUM_BYTES, BlockChecksum
from worker.dataplane.layout import DTYPE_CODES, BlockLayout

VERSION = 1
FIXED = struct.Struct("<8sHHIQQI16s16s")  # magic, version, flags, layers, layer_bytes, data_bytes, dtype, key, checksum
HASH_BYTES = 8


class HeaderInvalid(ValueError):
    """A stored header does not describe the block asked for; the message says why."""


def header_length(layout: BlockLayout) -> int:
    """Bytes of a header for this layout (before any padding a tier adds)."""
    return FIXED.size + CHECKSUM_BYTES * layout.layers + HASH_BYTES


def pack_header(*, magic: bytes, layout: BlockLayout, key: uuid.UUID, checksum: BlockChecksum) -> bytes:
    body = FIXED.pack(
        magic,
        VERSION,
        0,
        layout.layers,
        layout.layer_bytes,
        layout.block_bytes,
        DTYPE_CODES[layout.dtype],
        key.bytes,
        checksum.block,
    ) + b"".join(checksum.layers)
    return body + xxhash.xxh3_64(body).digest()


def parse_header(
    *, magic: bytes, layout: BlockLayout, key: uuid.UUID, raw: bytes | memoryview, holder: str
) -> BlockChecksum:
    """The checksum recorded in a header, after checking it is intact and belongs to `key` in
    `layout`; HeaderInvalid otherwise. `holder` names what holds the block ("file", "value")."""
    body_len = FIXED.size + CHECKSUM_BYTES * layout.layers
    body = bytes(raw[:body_len])
    if len(body) < body_len:
        raise HeaderInvalid("header is truncated")
    found_magic, version, _flags, layers, layer_bytes, data_bytes, dtype_code, key_bytes, block_sum = FIXED.unpack_from(
        body
    )
    if found_magic != magic or version != VERSION:
        raise HeaderInvalid(f"not a strata block {holder}")
    if xxhash.xxh3_64(body).digest() != bytes(raw[body_len : body_len + HASH_BYTES]):
        raise HeaderInvalid("header checksum mismatch")
    if key_bytes != key.bytes:
        raise HeaderInvalid(f"{holder} holds block {uuid.UUID(bytes=key_bytes)}")
    if (layers, layer_bytes, data_bytes, dtype_code) != (
        layout.layers,
        layout.layer_bytes,
        layout.block_bytes,
        DTYPE_CODES[layout.dtype],
    ):
        raise HeaderInvalid(f"{holder} holds a block of another layout")
    sums = body[FIXED.size :]
    checksum = BlockChecksum(
        block=block_sum,
        layers=tuple(sums[i : i + CHECKSUM_BYTES] for i in range(0, len(sums), CHECKSUM_BYTES)),
    )
    if not checksum.consistent(key):
        raise HeaderInvalid("block checksum does not match its layer checksums")
    return checksum
