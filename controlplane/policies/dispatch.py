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
from controlplane.policies.specs import PriorityClassSpec
from controlplane.settings.celery import CONTROL_QUEUE

log = logging.getLogger("strata.policies")

PLAN_TASK = "movements.plan"
APPLY_TASK = "node.apply_policies"


def policies_dispatch_on_commit(*, version: int, reason: str, classes: Sequence[PriorityClassSpec]) -> None:
    """Once the current transaction commits: ask the planner to plan again (`reason` is
    "policy-change" or "mode-switch") and send every up node the classes of `version` (the node
    enforces the device shares as it writes blocks)."""
    payload = [dataclasses.asdict(spec) for spec in classes]
    for item in payload:
        item["namespaces"] = list(item["namespaces"])
    transaction.on_commit(lambda: policies_dispatch(version=version, reason=reason, classes=payload))


def celery_app() -> Celery:
    """The control plane's Celery app (behind a function so tests can send to a recorder instead)."""
    return app


def policies_dispatch(*, version: int, reason: str, classes: list[dict[str, object]]) -> None:
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
            app.send_task(APPLY_TASK, kwargs={"version": version, "classes": classes}, queue=f"node.{name}")
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
