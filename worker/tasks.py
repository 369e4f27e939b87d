"""Node Celery tasks (queue node.<name>): thin wrappers that call the node runtime or a service."""

from celery import current_app, shared_task


@shared_task(name="node.report", ignore_result=True, acks_late=True)
def node_report() -> None:
    """Send this node's heartbeat now (the control plane asks after changing what a node holds)."""
    current_app.strata_runtime.heartbeat()
