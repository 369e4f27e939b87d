"""What one half of the connector opens (`Runtime`: the node's options, the model's profile, its
tiers, the directory and the offload manager), and the checks of vLLM's settings made before it
opens: the model's profile (keyed by the model as vLLM runs it, overrides included), the KV
cache layouts, parallelism and load-failure policy it can serve, the options the connector's
kv_connector_extra_config gives."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from worker.dataplane.config import NodeConfig, load_config
from worker.dataplane.directory import Directory
from worker.dataplane.layout import ModelProfile
from worker.dataplane.models.loading import checkpoint_config, checkpoint_profile
from worker.dataplane.offload import OffloadManager
from worker.dataplane.store import TieredStore

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

log = logging.getLogger("strata.vllm")

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

    policy_version: int = 0
    """The policy version this half enforces (0: none received yet)."""

    def apply_policies(
        self,
        *,
        version: int,
        classes: Sequence[Mapping[str, Any]] = (),
        tiers: Sequence[Mapping[str, Any]] = (),
        quotas: Sequence[Mapping[str, Any]] = (),
    ) -> bool:
        """Enforce policy `version` on this half's write-back: the host and disk tiers' eviction
        rules and the namespaces' quotas, and which classes write
        through to L3. vLLM's own pages are L1, so the device tier's rule and the classes' device
        shares are vLLM's to keep. Everything is parsed first (a bad field raises ValueError naming
        it, and nothing changes); an older version than the one in force is ignored."""
        if version < self.policy_version:
            return False
        self.manager.apply_policies(classes=classes, tiers=tiers, quotas=quotas, node_group=self.config.node_group)
        self.policy_version = version
        return True

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        self.store.close()


PolicyRead = Callable[[], tuple[int, Mapping[str, Any]]]
"""Reads the policies in force: (version, {"classes": [...], "tiers": [...], "quotas": [...]})."""


class PolicyFollower:
    """Keeps a connector half on the policies in force: reads them every `interval_s` and applies
    a new version (`Runtime.apply_policies`). A failed read or a payload it cannot apply is logged
    once per kind and retried at the next interval; the policy in force stays meanwhile."""

    def __init__(self, runtime: Runtime, read: PolicyRead, *, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be above zero, got {interval_s}")
        self.runtime = runtime
        self.read = read
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = ""

    def poll(self) -> bool:
        """Read once and apply a new version; True when one was applied."""
        try:
            version, payload = self.read()
            if version == self.runtime.policy_version:
                return False
            applied = self.runtime.apply_policies(
                version=version,
                classes=payload.get("classes", ()),
                tiers=payload.get("tiers", ()),
                quotas=payload.get("quotas", ()),
            )
        except Exception as exc:  # noqa: BLE001 - the policy in force stays; read again next interval
            kind = type(exc).__name__
            if kind != self._failing:
                log.warning("StrataConnector: could not apply the policies in force (retrying): %s", exc)
            self._failing = kind
            return False
        if self._failing:
            log.info("StrataConnector: policies read again")
            self._failing = ""
        if applied:
            log.info("StrataConnector on node %s: policy version %d in force", self.runtime.config.node_name, version)
        return applied

    def start(self) -> PolicyFollower:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="strata-policies", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def profile_for(vllm_config: VllmConfig, config: NodeConfig) -> ModelProfile:
    """The profile of the model vLLM serves (a checkpoint directory, or a hub id at vLLM's
    revision, from the local hub cache), as Strata's own engine would key the same checkpoint,
    plus what vLLM runs differently from the checkpoint (`runtime_settings`): two servers of one
    checkpoint share blocks only where those settings are the same."""
    model = vllm_config.model_config
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(
            f"StrataConnector: kv cache dtype {vllm_config.cache_config.cache_dtype} is not stored; "
            f"run with --kv-cache-dtype auto"
        )
    profile = checkpoint_profile(
        model.model,
        dtype=model.dtype,
        block_tokens=config.block_tokens,
        revision=model.revision,
        cache_dir=config.cache_dir,
    )
    settings = runtime_settings(model, checkpoint_config(model.model, revision=model.revision))
    if not settings:
        return profile
    digest = hashlib.blake2b(_canonical(settings).encode(), digest_size=16, person=b"strata-runtime").hexdigest()
    log.info(
        "StrataConnector: %s runs with settings that change its KV (%s): its blocks are keyed apart from the "
        "checkpoint's as it is on disk",
        profile.model_id,
        ", ".join(sorted(settings)),
    )
    return dataclasses.replace(profile, revision=f"{profile.revision}+runtime-{digest}")


LENGTH_DEPENDENT_ROPE = frozenset({"longrope", "su"})
"""RoPE types whose factors vLLM picks by max_model_len (Phi-3's LongRoPE: the long factors
whenever max_model_len exceeds original_max_position_embeddings)."""


def runtime_settings(model: ModelConfig, on_disk: Mapping[str, Any]) -> dict[str, Any]:
    """What vLLM runs differently from the checkpoint on disk, in ways that change the KV: every
    field of the model config (as vLLM uses it, after --hf-overrides) that differs from the
    checkpoint's config.json, the quantization method, and for a RoPE whose factors depend on it
    whether max_model_len selects the long factors. Empty when vLLM runs the checkpoint as it is."""
    runs = model.hf_config.to_dict()
    settings: dict[str, Any] = {}
    changed = {
        name: runs.get(name)
        for name in sorted(set(runs) | set(on_disk))
        if _canonical(runs.get(name)) != _canonical(on_disk.get(name))
    }
    if changed:
        settings["hf_config"] = changed
    if model.quantization:
        settings["quantization"] = str(model.quantization)
    rope = runs.get("rope_parameters") or runs.get("rope_scaling") or {}
    ropes = list(rope.values()) if rope and all(isinstance(v, Mapping) for v in rope.values()) else [rope]
    if any(r.get("rope_type", r.get("type")) in LENGTH_DEPENDENT_ROPE for r in ropes if isinstance(r, Mapping)):
        original = runs.get("original_max_position_embeddings") or runs.get("max_position_embeddings")
        settings["long_rope"] = original is not None and model.max_model_len > int(original)
    return settings


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


SERVED_KV = "full attention"


def check_kv_cache(kv_cache_config: KVCacheConfig | None, model: str) -> None:
    """Refuse, in one line naming the layer kind and the model, a KV cache Strata cannot key and
    move exactly: anything but one group of full-attention layers. Strata reads and writes every
    token of every layer's pages; a sliding window (whose out-of-window pages vLLM gives up to its
    null page), a state-space layer, a latent (MLA) or cross-attention cache would be stored or
    loaded half right."""
    if kv_cache_config is None:
        return
    groups = kv_cache_config.kv_cache_groups
    kinds = sorted({kind for group in groups for kind in _kinds(group.kv_cache_spec)} - {SERVED_KV})
    if kinds:
        odd = [name for group in groups if _kinds(group.kv_cache_spec) != {SERVED_KV} for name in group.layer_names]
        what = f"{' and '.join(kinds)} layers ({_some(odd)})"
    elif len(groups) > 1:
        what = f"its layers in {len(groups)} KV cache groups ({_some([g.layer_names[0] for g in groups])}, ...)"
    else:
        return
    raise ValueError(
        f"StrataConnector: model {model} has {what}; Strata serves one group of {SERVED_KV} KV caches only: "
        "serve this model without the connector"
    )


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def _kinds(spec: KVCacheSpec) -> set[str]:
    """The layer kinds of a KV cache group's spec, in words."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return {kind for inner in spec.kv_cache_specs.values() for kind in _kinds(inner)}
    if type(spec) is FullAttentionSpec:
        if spec.sliding_window is not None:
            return {"sliding-window attention (allocated as full attention)"}
        if spec.attention_chunk_size is not None:
            return {"chunked local attention (allocated as full attention)"}
        return {SERVED_KV}
    return {LAYER_KINDS.get(type(spec).__name__, type(spec).__name__)}


LAYER_KINDS = {
    "SlidingWindowSpec": "sliding-window attention",
    "SlidingWindowMLASpec": "sliding-window latent attention (MLA)",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "MLAAttentionSpec": "multi-head latent attention (MLA)",
    "HiddenStateCacheSpec": "hidden-state cache",
    "MambaSpec": "Mamba (state-space)",
    "CrossAttentionSpec": "cross-attention",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SinkFullAttentionSpec": "attention-sink",
    "RSWASpec": "sliding-window attention",
    "CircularBufferSpec": "circular-buffer attention",
}
"""vLLM's KV cache spec classes, by name, as the refusal names them (another class is named as is)."""


SUPPORTED_VLLM = ((0, 32), (0, 34))
"""The vLLM releases the connector is written against, oldest and newest (major, minor): its
scheduler and worker halves meet each one's connector API (0.34 resumes a preempted request among
the new ones, and its Request carries block_hashes)."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM the connector was not written against (its scheduler output or Request may
    have changed in ways that would go unnoticed), naming the versions it supports."""
    from packaging.version import InvalidVersion, Version

    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    supported = f"{low_major}.{low_minor} to {high_major}.{high_minor}"
    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        raise ValueError(
            f"StrataConnector: cannot read vLLM's version {version!r}; it supports vLLM {supported}"
        ) from None
    if not SUPPORTED_VLLM[0] <= release <= SUPPORTED_VLLM[1]:
        raise ValueError(
            f"StrataConnector supports vLLM {supported}; this is vLLM {version} (install a supported vLLM, "
            "or a Strata release written for this one)"
        )


def check_engine(vllm_config: VllmConfig) -> None:
    """Refuse, by setting, an engine the connector cannot serve correctly."""
    import vllm

    check_vllm_version(vllm.__version__)
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_load_failure_policy != "recompute":
        raise ValueError(
            'StrataConnector: kv_transfer_config needs "kv_load_failure_policy": "recompute" (a block '
            f"that fails its checksum is recomputed, never served); it is "
            f'"{transfer.kv_load_failure_policy}"'
        )
    parallel = vllm_config.parallel_config
    # A dense model's data-parallel ranks reach the connector as independent engines of one rank
    # each (vLLM sets data_parallel_size to 1 in each); a mixture of experts keeps its ranks in one
    # process group, across which the gather of a block's shares is not set up.
    if parallel.data_parallel_size != 1 and parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "StrataConnector: with --data-parallel-size above 1 on a mixture-of-experts model, each data-parallel "
            "rank must be one worker (--tensor-parallel-size and --pipeline-parallel-size 1: the gather of a "
            f"block's shares spans one rank's workers only); got data {parallel.data_parallel_size}, tensor "
            f"{parallel.tensor_parallel_size}, pipeline {parallel.pipeline_parallel_size}"
        )


def node_options(extra: Mapping[str, Any]) -> NodeConfig:
    """The node's options, the connector's extra config first (its keys are option names)."""
    overrides = {key: value for key, value in extra.items() if key not in VLLM_ONLY_KEYS}
    return load_config(overrides=overrides)
