"""The remote tier's Redis/Valkey client: how it is made, and which of its errors mean the server
is not there (the tier raises TierUnavailable for those)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
import redis.backoff
import redis.cluster
import redis.exceptions
import redis.retry

from worker.dataplane.network import ConnectionOptions

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


def redis_client(
    url: str, *, cluster: bool = False, timeout_s: float = 2.0, connection: ConnectionOptions | None = None
) -> RedisClient:
    """A redis-py client for the remote tier: short timeouts, so a dead or silent server turns
    into TierUnavailable within `timeout_s` instead of hanging the loader; TCP keepalives (and
    the TCP user timeout) on a TCP URL and health checks of idle connections, as `connection`
    says. A command that timed out is not sent again (the server that kept silent once is likely
    to again, and each try costs `timeout_s`); one that lost its connection is, once, at once (a
    connection left from before a server restart)."""
    connection = connection or ConnectionOptions()
    retry = redis.retry.Retry(
        redis.backoff.ExponentialBackoff(cap=0.05, base=0.005),
        retries=1,
        supported_errors=(redis.exceptions.ConnectionError,),
    )
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": retry,
        **connection.redis(),
    }
    if urlsplit(url).scheme == "unix":  # no TCP under a unix socket
        del options["socket_keepalive"], options["socket_keepalive_options"]
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)
