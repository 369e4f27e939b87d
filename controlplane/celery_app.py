"""The Celery application of the control plane and the node workers (configured from Django settings)."""

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.dev")

app = Celery("strata")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _refuse_evicting_redis(sender: Any = None, **kwargs: Any) -> None:
    """Every worker (the control queue's, a node's) stops at start on a Redis that would evict
    its queues."""
    from controlplane.runtime.redis_check import refuse_evicting_redis

    refuse_evicting_redis("Celery worker")
