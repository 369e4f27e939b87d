"""The Redis eviction policies Strata refuses: ones that drop any key when memory runs out.

Under `allkeys-*` Redis evicts whatever it picks: L3 values (a miss, harmless), but also the L3
usage hash (the count starts again from nothing) and, when L3 shares the deployment's Redis, the
Celery queues and unacknowledged messages (work lost without a trace). `noeviction` makes a full
Redis refuse writes (the tier reports itself full), and the `volatile-*` policies evict only keys
with an expiry, which Strata gives only to what may vanish.
"""

from __future__ import annotations

import logging

import redis
import redis.exceptions

log = logging.getLogger("strata.tiers")

EVICTING_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})


class EvictingRedis(ValueError):
    """The Redis at hand evicts keys Strata cannot lose."""


def eviction_refusal(client: redis.Redis | redis.cluster.RedisCluster, where: str) -> str:
    """Why Strata must not run on this Redis ('' when it may): its maxmemory-policy, read with
    INFO (a node's own Redis user may run INFO, not CONFIG). A Redis that does not answer is
    the caller's to handle later; one that will not say is logged and let through."""
    try:
        info = client.info("memory")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return ""
    except redis.exceptions.RedisError as exc:
        log.warning("%s: cannot read Redis's maxmemory-policy (%s); make sure it is noeviction", where, exc)
        return ""
    if isinstance(client, redis.cluster.RedisCluster):  # one entry per node: every node must be safe
        policies = {str(node.get("maxmemory_policy", "")) for node in info.values() if isinstance(node, dict)}
    else:
        policies = {str(info.get("maxmemory_policy", ""))}
    evicting = sorted(policies & EVICTING_POLICIES)
    if not evicting:
        return ""
    return (
        f"{where}: Redis's maxmemory-policy is {evicting[0]}, which evicts any key when memory runs out "
        "(Celery queues, the L3 usage hash, unacknowledged messages); set maxmemory-policy noeviction "
        "(or a volatile-* policy)"
    )


def refuse_evicting(client: redis.Redis | redis.cluster.RedisCluster, where: str) -> None:
    """Raise EvictingRedis naming the policy when this Redis may evict any key."""
    if reason := eviction_refusal(client, where):
        raise EvictingRedis(reason)
