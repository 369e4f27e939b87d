"""The StrataConnector vLLM loads (by name, registered by worker.vllm_plugin; or with
kv_connector_module_path "worker.vllm_connector"): the data plane's connector with the fleet's
directory (the control plane's PostgreSQL) and its L3 Redis.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \\
      '{"kv_connector": "StrataConnector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node_name": "gpu-0"}}'

It reads the control plane's settings as every Strata process does (DJANGO_SETTINGS_MODULE,
DATABASE_URL, REDIS_URL) and the node's options as `strata_node` does (STRATA_* variables,
overridden by kv_connector_extra_config). `strata_node --engine vllm` starts vLLM this way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from worker.dataplane.config import NodeConfig
from worker.dataplane.connectors.vllm import StrataConnectorBase
from worker.dataplane.connectors.vllm.runtime import PolicyRead
from worker.dataplane.directory import Directory
from worker.dataplane.layout import ModelProfile

log = logging.getLogger("strata.vllm")


def _django() -> None:
    """Set up the control plane's settings in this process (vLLM's engine and worker processes)."""
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.dev")
        django.setup()


class StrataConnector(StrataConnectorBase):
    """StrataConnector with the fleet's block directory and policies."""

    def open_directory(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Directory | None:
        _django()
        from controlplane.node_api import modelprofile_ensure, namespace_ensure
        from worker.connections import database_options_apply
        from worker.postgres_directory import DirectoryOptions, PostgresDirectory

        database_options_apply(config)  # this process's own queries (models, namespaces, policies)

        if role == KVConnectorRole.SCHEDULER:
            # Registrations of an unknown model or namespace are refused; a node started before the
            # database answers retries them (DirectoryOptions.unknown_grace_s) and serves meanwhile.
            try:
                modelprofile_ensure(profile=profile)
                namespace_ensure(name=config.default_namespace)
            except Exception as exc:  # noqa: BLE001 - serving goes on from the node's tiers
                log.warning(
                    "StrataConnector: could not record model %s in the directory yet: %s", profile.model_id, exc
                )
        return PostgresDirectory(options=DirectoryOptions.from_config(config))

    def policies_source(self) -> PolicyRead:
        """The policies in force, read from the control plane's tables as a Strata node reads them
        at each heartbeat (the host and disk eviction rules, the quotas, the classes that write
        through to L3); each connector half follows them every heartbeat interval."""
        _django()
        from controlplane.node_api import policies_in_force

        def read() -> tuple[int, Mapping[str, object]]:
            from django.db import close_old_connections

            close_old_connections()
            return policies_in_force()

        return read

    def store_environ(self) -> Mapping[str, str] | None:
        _django()
        from django.conf import settings

        # With no STRATA_REMOTE_URL, L3 lives in the deployment's Redis (its own logical database), as on every node.
        return {**os.environ, "REDIS_URL": settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)}
