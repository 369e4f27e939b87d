"""Channels integration: the websocket channel layer on Redis (lossy by design; deltas carry sequence numbers)."""

from typing import Any

from controlplane.runtime.environment import Environment


def settings(env: Environment) -> dict[str, Any]:
    return {
        "ASGI_APPLICATION": "controlplane.asgi.application",
        "CHANNEL_LAYERS": {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {
                    "hosts": [env.redis.url_for_db(env.redis.db + 1)],
                    "capacity": 500,
                    "expiry": 30,
                },
            }
        },
        # Dashboard sequence numbers and other small shared counters.
        "STRATA_REDIS_URL": env.redis.url_for_db(env.redis.db + 1),
    }
