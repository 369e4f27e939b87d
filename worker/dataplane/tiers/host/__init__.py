"""The host tier: a DRAM pool in POSIX shared memory shared by every process of a node (`tier.HostTier`).

    tier.py         HostTier: opening the pool, writes (put, put_many, put_from), delete, keys, usage
    reads.py        the lock-free verified reads (generic and native) and the per-process lookup cache
    slots.py        slot allocation, release and reclaiming crashed writers' slots
    key_index.py    the key index (open addressing, tombstones, seqlocked rebuilds)
    pool_layout.py  the pool file's layout, creating and mapping it, pinning, the pool lock

The layout and the concurrency protocol are drawn in `tier`'s docstring.
"""

from worker.dataplane.tiers.host.key_index import INDEX_EMPTY, INDEX_GONE
from worker.dataplane.tiers.host.pool_layout import FREE, MAGIC, READY, SHM_DIR, VERSION, WRITING
from worker.dataplane.tiers.host.reads import READ_ATTEMPTS
from worker.dataplane.tiers.host.tier import HostTier

__all__ = [
    "FREE",
    "INDEX_EMPTY",
    "INDEX_GONE",
    "MAGIC",
    "READ_ATTEMPTS",
    "READY",
    "SHM_DIR",
    "VERSION",
    "WRITING",
    "HostTier",
]
