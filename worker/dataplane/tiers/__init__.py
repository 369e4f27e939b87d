"""The storage tiers of a node behind one interface (see `base.Tier`).

base.py     the Tier interface, and its result records (the levels themselves, fastest first, are
            `tier_names.TIER_ORDER`)
mediums.py  one spec per medium, each opening its tier; a level's medium is configuration
device.py   pages of GPU memory
host/       a shared-memory pool every process of the node maps
disk/       one file per block in a directory, local or on a shared mount
remote/     Redis/Valkey, standalone or cluster
header.py   the header that disk files and Redis values carry (key, layout, checksums)
"""

from worker.dataplane.tiers.base import PutResult, ReadResult, Tier, TierUsage

__all__ = ["PutResult", "ReadResult", "Tier", "TierUsage"]
