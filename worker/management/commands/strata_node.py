"""Run a GPU node: its Celery worker on queue node.<name> and its heartbeat."""

import logging
import os
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
        parser.add_argument(
            "--allow-owner-credential",
            action="store_true",
            help="start even when the database user is a superuser or owns the directory's tables "
            "(STRATA_NODE_ALLOW_OWNER_CREDENTIAL=true); a node should run on its own credential "
            "(manage.py strata_node_credential NAME)",
        )
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args: Any, loglevel: str, allow_owner_credential: bool, **options: Any) -> None:
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
        from worker.connections import database_options_apply

        database_options_apply(config)  # before the first query (the credential check below)
        logging.getLogger("strata").setLevel(loglevel.upper())
        allowed = allow_owner_credential or os.environ.get("STRATA_NODE_ALLOW_OWNER_CREDENTIAL", "").lower() in (
            "1",
            "true",
            "yes",
        )
        self._check_credential(config.node_name, allowed=allowed)
        from controlplane.celery_app import app
        from worker.node import run_node

        sys.exit(run_node(app, config, loglevel=loglevel.upper()))

    def _check_credential(self, node: str, *, allowed: bool) -> None:
        """Refuse a database user that could rewrite the whole fleet (superuser, owner of the
        directory's tables, or one that bypasses row-level security), unless told to allow it."""
        from django.db import DatabaseError, connection

        from controlplane.node_api import credential_too_strong

        try:
            problem = credential_too_strong()
        except DatabaseError as exc:
            self.stderr.write(f"strata_node: cannot check the database credential: {exc}".rstrip())
            sys.exit(2)
        finally:
            connection.close()
        if not problem:
            return
        if allowed:
            logging.getLogger("strata.node").warning(
                "node %s runs with the control plane's database credential (%s): it can change every "
                "node's rows; give it its own with `manage.py strata_node_credential %s`",
                node,
                problem,
                node,
            )
            return
        self.stderr.write(
            f"strata_node: {problem}: a node runs on its own credential (`manage.py strata_node_credential "
            f"{node}` prints its DATABASE_URL), or pass --allow-owner-credential to run it anyway"
        )
        sys.exit(2)
