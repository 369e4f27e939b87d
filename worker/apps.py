"""App config of the node runtime (management command strata_node, node tasks)."""

from django.apps import AppConfig


class WorkerConfig(AppConfig):
    name = "worker"
    label = "worker"
    verbose_name = "Node runtime"
