"""At start, every control-plane process and node worker refuses a Redis that evicts any key
(`worker.dataplane.redis_policy`): the broker's queues and the L3 usage hash live there."""

from __future__ import annotations

import redis
from django.conf import settings

from worker.dataplane.redis_policy import eviction_refusal


def deployment_redis_refusal(who: str) -> str:
    """Why `who` must not start on the deployment's Redis (REDIS_URL), or ''."""
    env = settings.ENV.redis
    client = redis.Redis.from_url(env.url_for_db(env.db), socket_timeout=2, socket_connect_timeout=2)
    try:
        return eviction_refusal(client, f"{who}: REDIS_URL")
    finally:
        client.close()


def refuse_evicting_redis(who: str) -> None:
    """Stop the process, naming the policy, when the deployment's Redis may evict any key."""
    if reason := deployment_redis_refusal(who):
        raise SystemExit(reason)
