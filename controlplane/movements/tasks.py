"""Control-plane Celery tasks of movements (queue `control`): plan on request, the watermark and
quota beats, and the fan-out of scrubs and reconciles to the nodes."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from controlplane.celery_app import app
from controlplane.directory.choices import NodeState, TierLevel
from controlplane.directory.models import Node, NodeTier
from controlplane.movements.choices import MovementReason
from controlplane.movements.selectors import nodes_over_watermark
from controlplane.movements.services import movements_plan, movements_redispatch
from controlplane.policies.snapshot import policies_snapshot

log = logging.getLogger("strata.movements")


@shared_task(name="movements.plan", ignore_result=True, acks_late=True)
def movements_plan_task(reason: str = "schedule", node: str | None = None) -> dict:
    """Plan and dispatch now (sent by name after a policy change, a mode switch or a schedule)."""
    return movements_plan(reason=reason, node=node).summary()


@shared_task(name="movements.plan_watermarks", ignore_result=True)
def movements_plan_watermarks_task() -> list[str]:
    """Beat job: plan for every node whose reported tier use is over its high watermark."""
    snapshot = policies_snapshot()
    over, remote_over = nodes_over_watermark(snapshot=snapshot)
    if remote_over:
        movements_plan(snapshot=snapshot, reason="watermark")
        return ["*"]
    for name in over:
        movements_plan(snapshot=snapshot, node=name, reason="watermark")
    return over


@shared_task(name="movements.plan_quotas", ignore_result=True)
def movements_plan_quotas_task() -> dict:
    """Beat job: move the coldest copies of every namespace over its quota out of the tiers it is
    over (the quota pass alone, fleet-wide)."""
    return movements_plan(reason=MovementReason.QUOTA, quotas_only=True).summary()


def _fan_out(task: str) -> list[str]:
    up = list(Node.objects.filter(state=NodeState.UP).order_by("name").values_list("name", flat=True))
    # The shared remote tier is checked by one node, in turn.
    remote = list(
        NodeTier.objects.filter(node__name__in=up, tier=TierLevel.REMOTE, available=True)
        .order_by("node__name")
        .values_list("node__name", flat=True)
    )
    chosen = remote[_turn() % len(remote)] if remote else None
    for name in up:
        app.send_task(task, kwargs={"include_remote": name == chosen}, queue=f"node.{name}")
    return up


def _turn() -> int:
    """Changes every minute, so the remote tier's check rotates among the nodes."""
    return int(timezone.now().timestamp() // 60)


@shared_task(name="movements.scrub_nodes", ignore_result=True)
def movements_scrub_nodes_task() -> list[str]:
    """Beat job: ask every up node to scrub its tiers."""
    return _fan_out("node.scrub")


@shared_task(name="movements.reconcile_nodes", ignore_result=True)
def movements_reconcile_nodes_task() -> list[str]:
    """Beat job: ask every up node to reconcile its tiers with the directory."""
    return _fan_out("node.reconcile")


@shared_task(name="movements.redispatch", ignore_result=True)
def movements_redispatch_task() -> dict[str, int]:
    """Beat job: queue stuck movements again, cancel the ones whose node is gone."""
    return movements_redispatch(older_than=timedelta(minutes=10))
