"""The StrataConnector vLLM loads (kv_connector_module_path "worker.vllm_connector"): the data
plane's connector with the fleet's directory (the control plane's PostgreSQL) and its L3 Redis.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \\
      '{"kv_connector": "StrataConnector", "kv_connector_module_path": "worker.vllm_connector",
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
    """StrataConnector with the fleet's block directory."""

    def open_directory(self, config: NodeConfig, profile: ModelProfile, role: KVConnectorRole) -> Directory | None:
        _django()
        from controlplane.directory.services import modelprofile_ensure, namespace_ensure
        from worker.directory import PostgresDirectory

        if role == KVConnectorRole.SCHEDULER:
            # Registrations of an unknown model or namespace are refused; a node started before the
            # database answers retries them (DirectoryOptions.unknown_grace_s) and serves meanwhile.
            try:
                modelprofile_ensure(profile=profile)
                namespace_ensure(name="default")
            except Exception as exc:  # noqa: BLE001 - serving goes on from the node's tiers
                log.warning(
                    "StrataConnector: could not record model %s in the directory yet: %s", profile.model_id, exc
                )
        return PostgresDirectory()

    def store_environ(self) -> Mapping[str, str] | None:
        _django()
        from django.conf import settings

        # With no STRATA_REMOTE_URL, L3 lives in the deployment's Redis (its own logical database), as on every node.
        return {**os.environ, "REDIS_URL": settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)}
