"""Node Celery tasks (queue node.<name>): thin wrappers that call the node runtime or a service.

The movement tasks take plain ids and are safe to run twice: each resumes from what the directory
says. They ack late and are rejected (so delivered again) when their worker is lost; a database or
Redis outage makes them retry with backoff instead of failing."""

from typing import Any

from celery import current_app, shared_task

from worker.dataplane.tier_names import DEVICE, REMOTE
from worker.movement_executor import TRANSIENT_ERRORS, executor_for

_MOVEMENT_TASK: dict[str, Any] = {
    "ignore_result": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": 1,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 60,
}


@shared_task(name="node.report", ignore_result=True, acks_late=True)
def node_report() -> None:
    """Send this node's heartbeat now (the control plane asks after changing what a node holds)."""
    current_app.strata_runtime.heartbeat()


@shared_task(name="node.apply_policies", ignore_result=True, acks_late=True)
def node_apply_policies(
    version: int,
    classes: list[dict[str, Any]] | None = None,
    tiers: list[dict[str, Any]] | None = None,
    quotas: list[dict[str, Any]] | None = None,
) -> None:
    """Enforce policy `version` on this node. The message only says that a version changed: what
    is enforced is read from the directory, which only the control plane writes, so a message
    forged by anything else that reaches this queue cannot change the node's policies."""
    current_app.strata_runtime.policies_announced(version=version)


@shared_task(name="node.move", **_MOVEMENT_TASK)
def node_move(movement_ids: list[int]) -> None:
    """Move blocks to a slower tier: copy, verify, flip the placement (epoch-fenced), free the source."""
    executor_for(current_app).run("move", movement_ids)


@shared_task(name="node.evict", **_MOVEMENT_TASK)
def node_evict(movement_ids: list[int]) -> None:
    """Free copies: mark deleting (epoch-fenced), delete the bytes, forget the copy."""
    executor_for(current_app).run("evict", movement_ids)


@shared_task(name="node.warm", **_MOVEMENT_TASK)
def node_warm(movement_ids: list[int]) -> None:
    """Copy remote blocks into this node's host tier ahead of use (the remote copy stays)."""
    executor_for(current_app).run("warm", movement_ids)


def _tiers(tiers: list[str] | None, include_remote: bool) -> list[str]:
    store = current_app.strata_runtime.store
    if store is None:
        return tiers or []
    chosen = tiers or [t for t in store.names if t not in (DEVICE, REMOTE)]
    if include_remote and REMOTE in store.names and REMOTE not in chosen:
        chosen.append(REMOTE)
    return chosen


@shared_task(name="node.scrub", **_MOVEMENT_TASK)
def node_scrub(tiers: list[str] | None = None, include_remote: bool = False) -> None:
    """Verify every READY copy this node holds (the shared remote ones too when asked)."""
    executor = executor_for(current_app)
    for tier in _tiers(tiers, include_remote):
        executor.scrub(tier)


@shared_task(name="node.reconcile", **_MOVEMENT_TASK)
def node_reconcile(tiers: list[str] | None = None, include_remote: bool = False) -> None:
    """Delete bytes no placement names (after a grace period); mark copies whose bytes vanished."""
    executor = executor_for(current_app)
    for tier in _tiers(tiers, include_remote):
        executor.reconcile(tier)
