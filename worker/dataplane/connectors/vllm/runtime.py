"""What one half of the connector opens (`Runtime`: the node's options, the model's profile, its
tiers, the directory and the offload manager), and the checks of vLLM's settings made before it
opens: the model's profile, the parallelism and load-failure policy it can serve, the options
the connector's kv_connector_extra_config gives."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.dataplane.config import NodeConfig, load_config
from worker.dataplane.directory import Directory
from worker.dataplane.engine.models import checkpoint_profile
from worker.dataplane.layout import ModelProfile
from worker.dataplane.offload import OffloadManager
from worker.dataplane.store import TieredStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_ONLY_KEYS = frozenset({"shared_storage_path"})
"""kv_connector_extra_config keys other connectors read; not node options, ignored here."""


@dataclasses.dataclass
class Runtime:
    """What one half of the connector opens: the node's options, the model's profile, its tiers
    (vLLM's own pages are L1: host, disk and remote here), the directory and the manager."""

    config: NodeConfig
    profile: ModelProfile
    store: TieredStore
    directory: Directory | None
    manager: OffloadManager

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        self.store.close()


def profile_for(vllm_config: VllmConfig, block_tokens: int) -> ModelProfile:
    """The profile of the model vLLM serves, as Strata's own engine would key the same checkpoint."""
    model = vllm_config.model_config
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(
            f"StrataConnector: kv cache dtype {vllm_config.cache_config.cache_dtype} is not stored; "
            f"run with --kv-cache-dtype auto"
        )
    return checkpoint_profile(model.model, dtype=model.dtype, block_tokens=block_tokens)


def check_engine(vllm_config: VllmConfig) -> None:
    """Refuse, by setting, an engine the connector cannot serve correctly."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_load_failure_policy != "recompute":
        raise ValueError(
            'StrataConnector: kv_transfer_config needs "kv_load_failure_policy": "recompute" (a block '
            f"that fails its checksum is recomputed, never served); it is "
            f'"{transfer.kv_load_failure_policy}"'
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "StrataConnector: one tensor- and pipeline-parallel rank only (a Strata block holds every "
            f"kv head of every layer); got tp {parallel.tensor_parallel_size}, "
            f"pp {parallel.pipeline_parallel_size}"
        )


def node_options(extra: Mapping[str, Any]) -> NodeConfig:
    """The node's options, the connector's extra config first (its keys are option names)."""
    overrides = {key: value for key, value in extra.items() if key not in VLLM_ONLY_KEYS}
    return load_config(overrides=overrides)
