"""Run a GPU node: its Celery worker on queue node.<name> and its heartbeat."""

import logging
import sys
from typing import Any

from django.core.management.base import BaseCommand

from worker.dataplane.config import ConfigError, describe_options, load_config


class Command(BaseCommand):
    help = "Run a Strata node: a Celery worker on queue node.<name> plus its heartbeat. " + " ".join(
        f"{row['variable']} (default {row['default']}): {row['description']}" for row in describe_options()
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--name", dest="node_name", help="node name (STRATA_NODE_NAME)")
        parser.add_argument("--address", dest="node_address", help="host:port of this node's engine server")
        parser.add_argument("--device-bytes", dest="device_bytes", help="L1 device pool capacity, e.g. 8GiB")
        parser.add_argument("--host-bytes", dest="host_bytes", help="L2 DRAM pool capacity")
        parser.add_argument("--disk-bytes", dest="disk_bytes", help="L2 NVMe tier capacity")
        parser.add_argument("--disk-path", dest="disk_path", help="L2 NVMe tier directory")
        parser.add_argument("--remote-bytes", dest="remote_bytes", help="L3 capacity accounted to this node")
        parser.add_argument("--heartbeat-seconds", dest="heartbeat_seconds", help="seconds between heartbeats")
        parser.add_argument("--concurrency", dest="worker_concurrency", help="task threads")
        parser.add_argument(
            "--model",
            dest="model",
            help="model to serve: a preset (tiny, small, bench) or a local checkpoint directory",
        )
        parser.add_argument("--serve-port", dest="serve_port", help="port of the node's OpenAI-compatible server")
        parser.add_argument("--tiers", dest="tiers", help="tiers of this node, e.g. device,host,disk,remote")
        parser.add_argument("--engine", dest="engine", help="engine serving the model: strata or vllm")
        parser.add_argument("--status-port", dest="status_port", help="port of a vLLM node's Strata endpoints")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args: Any, loglevel: str, **options: Any) -> None:
        overrides = {
            key: options[key]
            for key in (
                "node_name",
                "node_address",
                "device_bytes",
                "host_bytes",
                "disk_bytes",
                "disk_path",
                "remote_bytes",
                "heartbeat_seconds",
                "worker_concurrency",
                "model",
                "serve_port",
                "tiers",
                "engine",
                "status_port",
            )
            if options.get(key) is not None
        }
        try:
            config = load_config(overrides=overrides)
        except ConfigError as exc:
            self.stderr.write(f"strata_node: {exc}")
            sys.exit(2)
        logging.getLogger("strata").setLevel(loglevel.upper())
        from controlplane.celery_app import app
        from worker.node import run_node

        sys.exit(run_node(app, config, loglevel=loglevel.upper()))
