"""The remote tier on Redis/Valkey (`tier.RemoteTier`), standalone or cluster.

tier.py        RemoteTier: values, pipelined layer reads, whole-block GETs
accounting.py  the usage hash every node shares: reservations with leases, settles, the recount
wire.py        SET sent from block memory and GET received into it, straight on the socket
client.py      the redis-py client and the errors that mean the server is not there
"""

from worker.dataplane.tiers.remote.client import UNAVAILABLE_ERRORS, RedisClient, redis_client
from worker.dataplane.tiers.remote.tier import MAGIC, PIPELINE_BYTES, READ_CHUNK_BYTES, RemoteTier

__all__ = [
    "MAGIC",
    "PIPELINE_BYTES",
    "READ_CHUNK_BYTES",
    "UNAVAILABLE_ERRORS",
    "RedisClient",
    "RemoteTier",
    "redis_client",
]
