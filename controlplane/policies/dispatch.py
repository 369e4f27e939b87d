"""The one place where a policy change reaches other processes: the planner and every node.

Tasks are sent by name (their code lives with the movements app and the node workers), and only
after the change commits, so nobody acts on a policy that was rolled back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from celery import Celery
from django.db import transaction
from kombu.exceptions import KombuError

from controlplane.celery_app import app
from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.policies.specs import PolicySnapshot
from controlplane.settings.celery import CONTROL_QUEUE

log = logging.getLogger("strata.policies")

PLAN_TASK = "movements.plan"
APPLY_TASK = "node.apply_policies"


def node_policies(snapshot: PolicySnapshot) -> dict[str, list[dict[str, object]]]:
    """What a node enforces itself, as plain JSON data: the priority classes (device shares,
    remote writes), the tier policies (local eviction and the device working set) and the quotas."""
    classes = [dataclasses.asdict(spec) for spec in snapshot.classes]
    for item in classes:
        item["namespaces"] = list(item["namespaces"])
    return {
        "classes": classes,
        "tiers": [dataclasses.asdict(spec) for spec in snapshot.tiers],
        "quotas": [dataclasses.asdict(spec) for spec in snapshot.quotas],
    }


def policies_dispatch_on_commit(*, version: int, reason: str, snapshot: PolicySnapshot) -> None:
    """Once the current transaction commits: ask the planner to plan again (`reason` is
    "policy-change" or "mode-switch") and send every up node the policies of `version` it
    enforces itself (`node_policies`)."""
    payload = node_policies(snapshot)
    transaction.on_commit(lambda: policies_dispatch(version=version, reason=reason, **payload))


def celery_app() -> Celery:
    """The control plane's Celery app (behind a function so tests can send to a recorder instead)."""
    return app


def policies_dispatch(
    *,
    version: int,
    reason: str,
    classes: list[dict[str, object]],
    tiers: Sequence[dict[str, object]] = (),
    quotas: Sequence[dict[str, object]] = (),
) -> None:
    """Send the planner and the nodes their tasks now. A broker that cannot be reached loses
    nothing: the version is stored, the planner's schedule picks it up and nodes read the
    classes again when they next apply policies; the log says so."""
    app = celery_app()
    try:
        app.send_task(PLAN_TASK, kwargs={"reason": reason}, queue=CONTROL_QUEUE)
    except (KombuError, OSError) as exc:
        log.warning(
            "policy version %d saved, but the planner was not told (%s); its schedule will pick it up", version, exc
        )
        return
    nodes = list(Node.objects.filter(state=NodeState.UP).order_by("name").values_list("name", flat=True))
    sent = 0
    for name in nodes:
        try:
            app.send_task(
                APPLY_TASK,
                kwargs={"version": version, "classes": classes, "tiers": list(tiers), "quotas": list(quotas)},
                queue=f"node.{name}",
            )
            sent += 1
        except (KombuError, OSError) as exc:
            log.warning("policy version %d not sent to node %s: %s", version, name, exc)
    log.info(
        "policy version %d (%s): planner asked to plan again, %d of %d up nodes sent the new classes",
        version,
        reason,
        sent,
        len(nodes),
    )
