"""Celery integration: JSON only, late acks, one queue per node, beat from the database."""

from typing import Any

from controlplane.runtime.environment import Environment

CONTROL_QUEUE = "control"


def settings(env: Environment) -> dict[str, Any]:
    return {
        "CELERY_BROKER_URL": env.redis.celery_url(env.redis.db),
        "CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP": True,
        # A move of the largest block finishes well within this; unacked messages come back after it.
        "CELERY_BROKER_TRANSPORT_OPTIONS": {"visibility_timeout": 3600},
        "CELERY_TASK_SERIALIZER": "json",
        "CELERY_RESULT_SERIALIZER": "json",
        "CELERY_ACCEPT_CONTENT": ["json"],
        "CELERY_TASK_ACKS_LATE": True,
        "CELERY_TASK_REJECT_ON_WORKER_LOST": True,
        "CELERY_WORKER_PREFETCH_MULTIPLIER": 1,
        "CELERY_TASK_TIME_LIMIT": 900,
        "CELERY_TASK_SOFT_TIME_LIMIT": 840,
        "CELERY_TASK_IGNORE_RESULT": True,
        "CELERY_TASK_DEFAULT_QUEUE": CONTROL_QUEUE,
        "CELERY_TASK_CREATE_MISSING_QUEUES": True,
        "CELERY_WORKER_HIJACK_ROOT_LOGGER": False,
        "CELERY_WORKER_SEND_TASK_EVENTS": False,
        "CELERY_BEAT_SCHEDULER": "django_celery_beat.schedulers:DatabaseScheduler",
        "CELERY_TIMEZONE": "UTC",
    }
