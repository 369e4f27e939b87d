"""The remote tier's Redis/Valkey client: how it is made, and which of its errors mean the server
is not there (the tier raises TierUnavailable for those)."""

from __future__ import annotations

from typing import Any

import redis
import redis.backoff
import redis.cluster
import redis.exceptions
import redis.retry

UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (Redis restarting)
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
)

ACCOUNTING_ERRORS = (*UNAVAILABLE_ERRORS, redis.exceptions.OutOfMemoryError)
"""Quota bookkeeping that fails after the data operation is dropped: the data is what counts."""

RedisClient = redis.Redis | redis.cluster.RedisCluster


def redis_client(url: str, *, cluster: bool = False, timeout_s: float = 2.0) -> RedisClient:
    """A redis-py client for the remote tier: short timeouts and one quick retry, so a dead
    server turns into TierUnavailable within a few seconds instead of hanging the loader."""
    retry = redis.retry.Retry(redis.backoff.ExponentialBackoff(cap=0.05, base=0.005), retries=1)
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": retry,
    }
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)
