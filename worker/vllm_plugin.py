"""vLLM's plugin hook (entry point group `vllm.general_plugins`, name `strata`): registers
StrataConnector with vLLM's connector factory, so that after `pip install strata-kv` vLLM finds it
by name alone:

    --kv-transfer-config '{"kv_connector": "StrataConnector", "kv_role": "kv_both"}'

vLLM calls it in each of its processes (API server, engine core, workers), possibly more than once
in one: registering twice is not an error here. The connector's module is imported only when vLLM
creates the connector, so a vLLM server without Strata configured pays nothing for the plugin.
"""

from __future__ import annotations

CONNECTOR_NAME = "StrataConnector"
CONNECTOR_MODULE = "worker.vllm_connector"


def register() -> None:
    """Register StrataConnector under its name (a no-op where it is already registered), and have
    vLLM's model runners note the model they load (fragment blending computes over it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from worker.dataplane.connectors.vllm.blend_model import remember_loaded_models

    remember_loaded_models()

    if CONNECTOR_NAME in KVConnectorFactory._registry:  # noqa: SLF001 - the factory's only membership test
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
