"""Control-plane Celery tasks of the directory (queue `control`)."""

import logging

from celery import shared_task

from controlplane.directory.services import nodes_mark_stale

log = logging.getLogger("strata.directory")


@shared_task(name="directory.nodes_mark_stale", ignore_result=True)
def nodes_mark_stale_task() -> list[str]:
    """Beat job: mark nodes stale after 3 missed heartbeats."""
    stale = nodes_mark_stale()
    if stale:
        log.warning("nodes stale after 3 missed heartbeats: %s", ", ".join(stale))
    return stale
