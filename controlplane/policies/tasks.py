"""Control-plane Celery tasks of the policies app (queue `control`)."""

import logging

from celery import shared_task

from controlplane.policies import following
from controlplane.policies.choices import LOAD_FOLLOW_TASK, MODE_SWITCH_TASK
from controlplane.policies.errors import PolicyError
from controlplane.policies.services import mode_activate

log = logging.getLogger("strata.policies")


@shared_task(name=MODE_SWITCH_TASK, ignore_result=True)
def mode_switch(name: str) -> int | None:
    """Beat job of a mode schedule: switch to mode `name`. Returns the new policy version, or None
    when the mode was already active or no longer exists (nothing to retry then)."""
    try:
        version = mode_activate(name=name, author="schedule", comment=f"scheduled switch to mode {name}")
    except PolicyError as exc:
        log.error("scheduled switch to mode %s not done: %s", name, exc)
        return None
    if version is None:
        log.info("scheduled switch to mode %s: already active, nothing to do", name)
        return None
    log.info("scheduled switch to mode %s: policy version %d in force", name, version.number)
    return version.number


@shared_task(name=LOAD_FOLLOW_TASK, ignore_result=True)
def load_follow() -> str:
    """Beat job (every 60 s): switch modes as the nodes' traffic calls for. Returns what it did."""
    result = following.load_follow()
    if result.action == "switched":
        log.info("%s (policy version %s)", result.reason, result.version)
    elif result.action not in ("disabled", "stay"):
        log.info("load-following %s: %s", result.action, result.reason)
    return result.action
