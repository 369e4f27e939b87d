"""The disk tier's block file header: its size, packing and parsing, and a cache of parsed headers."""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid

from worker.dataplane.buffers import DIRECT_IO_ALIGNMENT, round_up
from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.layout import DTYPE_CODES, BlockLayout
from worker.dataplane.tiers.header import header_length, pack_header, parse_header

MAGIC = b"STRATADK"
HEADER_CACHE_ENTRIES = 16384


def block_header_bytes(layout: BlockLayout) -> int:
    """Bytes of a block file's header: the packed header padded to the O_DIRECT alignment."""
    return round_up(header_length(layout), DIRECT_IO_ALIGNMENT)


def block_file_bytes(layout: BlockLayout) -> int:
    """Bytes of a whole block file: the header, then the block padded to the O_DIRECT alignment."""
    return block_header_bytes(layout) + round_up(layout.block_bytes, DIRECT_IO_ALIGNMENT)


@dataclasses.dataclass(frozen=True)
class Header:
    key: uuid.UUID
    checksum: BlockChecksum
    layers: int
    layer_bytes: int
    data_bytes: int
    dtype_code: int


@dataclasses.dataclass(frozen=True)
class Stamp:
    """Identity of one file version: a rename or rewrite changes it."""

    inode: int
    size: int
    mtime_ns: int


def header_of(layout: BlockLayout, key: uuid.UUID, checksum: BlockChecksum) -> Header:
    """The parsed header of a block of `layout` stored under `key` with `checksum`."""
    return Header(
        key=key,
        checksum=checksum,
        layers=layout.layers,
        layer_bytes=layout.layer_bytes,
        data_bytes=layout.block_bytes,
        dtype_code=DTYPE_CODES[layout.dtype],
    )


def pack_block_header(layout: BlockLayout, key: uuid.UUID, checksum: BlockChecksum) -> bytes:
    """The header of a block file, unpadded."""
    return pack_header(magic=MAGIC, layout=layout, key=key, checksum=checksum)


def parse_block_header(layout: BlockLayout, key: uuid.UUID, raw: memoryview) -> Header:
    """A block file's header; HeaderInvalid when it is not one of `key` in `layout`."""
    checksum = parse_header(magic=MAGIC, layout=layout, key=key, raw=raw, holder="file")
    return header_of(layout, key, checksum)


class HeaderCache:
    """Parsed headers of recently read or written blocks, each valid for one file version (its
    Stamp), so a read of a known block skips reading and parsing its header; least recently
    used first out."""

    def __init__(self, entries: int = HEADER_CACHE_ENTRIES) -> None:
        self._entries = entries
        self._headers: collections.OrderedDict[uuid.UUID, tuple[Stamp, Header]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: uuid.UUID, stamp: Stamp, header: Header) -> None:
        with self._lock:
            self._headers[key] = (stamp, header)
            self._headers.move_to_end(key)
            while len(self._headers) > self._entries:
                self._headers.popitem(last=False)

    def recall(self, key: uuid.UUID, stamp: Stamp) -> Header | None:
        with self._lock:
            cached = self._headers.get(key)
        return cached[1] if cached is not None and cached[0] == stamp else None

    def forget(self, key: uuid.UUID) -> None:
        with self._lock:
            self._headers.pop(key, None)
