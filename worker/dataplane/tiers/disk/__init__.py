"""The disk tier: blocks as files in a local or shared directory (`tier.DiskTier`).

tier.py            DiskTier: opening, reconcile, keys, delete, usage, sync, close
writes.py          staging a block in a temporary file, then commit (sync, rename), alone or grouped
reads.py           the verified read strategies (split, hashed in pieces, batched natively)
files.py           what reads and writes share: file paths, per-thread buffers, exact I/O
headers.py         the block file header, its sizes, and the cache of parsed headers
names.py           block and temporary file names, the host token in them
ledger.py          the capacity ledger shared by every process using the directory
unlinker.py        background unlinking of deleted files, and their reuse by puts
folder_sync.py     background fsyncs of the folders that make renames durable
gds.py             kvikio (GPUDirect Storage) reads and writes of GPU memory
"""

from worker.dataplane.tiers.disk.folder_sync import FOLDER_SYNC_DELAY_S
from worker.dataplane.tiers.disk.headers import (
    HEADER_CACHE_ENTRIES,
    MAGIC,
    block_file_bytes,
    block_header_bytes,
)
from worker.dataplane.tiers.disk.ledger import LEDGER_NAME
from worker.dataplane.tiers.disk.names import (
    FOREIGN_TEMP_GRACE_SECONDS,
    HOST_TOKEN_CHARS,
    host_token,
)
from worker.dataplane.tiers.disk.reads import READ_PIECE_BYTES, SPLIT_PIECE_BYTES
from worker.dataplane.tiers.disk.tier import DiskTier
from worker.dataplane.tiers.disk.unlinker import REUSE_DELETED_S

__all__ = [
    "FOLDER_SYNC_DELAY_S",
    "FOREIGN_TEMP_GRACE_SECONDS",
    "HEADER_CACHE_ENTRIES",
    "HOST_TOKEN_CHARS",
    "LEDGER_NAME",
    "MAGIC",
    "READ_PIECE_BYTES",
    "REUSE_DELETED_S",
    "SPLIT_PIECE_BYTES",
    "DiskTier",
    "block_file_bytes",
    "block_header_bytes",
    "host_token",
]
