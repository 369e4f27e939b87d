"""The connector keys the model vLLM serves as Strata's own engine keys it: a checkpoint directory,
a hub id at vLLM's revision (from the local hub cache), or that hub id's snapshot directory; and
keys apart what vLLM runs differently from the checkpoint (config overrides, quantization, a RoPE
chosen by max_model_len), with vLLM's own model config."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.engine.test_checkpoints import COMMIT, OTHER_COMMIT, hub_cache
from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.runtime import check_kv_cache, profile_for, runtime_settings
from worker.dataplane.hashing import model_key
from worker.dataplane.layout import ModelProfile
from worker.dataplane.models.checkpoints import REVISION_FILE
from worker.dataplane.models.loading import load_model, resolve_checkpoint, save_preset


def vllm_config(model: str, revision: str | None = None) -> SimpleNamespace:
    """The parts of vLLM's config the profile reads, for a checkpoint vLLM runs as it is."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_checkpoint(model, revision=revision).path, local_files_only=True)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=revision, dtype=torch.float32, hf_config=config, quantization=None, max_model_len=4096
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    checkpoint = save_preset("tiny", tmp_path / "saved", seed=0)
    snapshot = hub_cache(tmp_path / "hub", checkpoint)
    hub_cache(tmp_path / "hub", save_preset("tiny", tmp_path / "saved-v2", seed=1), commit=OTHER_COMMIT, ref="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_hub_model_is_keyed_as_the_engine_keys_it(hub):
    config = load_config(overrides={"block_tokens": 16}, environ={})
    served = profile_for(vllm_config("org/tiny"), config)  # type: ignore[arg-type]
    assert served == load_model("org/tiny", device="cpu").profile(16)
    assert (served.model_id, served.revision) == ("org--tiny", COMMIT)
    assert profile_for(vllm_config(str(hub)), config) == served  # type: ignore[arg-type]
    assert profile_for(vllm_config("org/tiny", "v2"), config).revision == OTHER_COMMIT  # type: ignore[arg-type]


def test_a_read_only_checkpoint_keeps_its_digest_where_the_node_options_say(tmp_path, monkeypatch):
    checkpoint = save_preset("tiny", tmp_path / "ckpt")
    monkeypatch.setattr("os.access", lambda path, mode: False)  # the directory counts as read-only
    config = load_config(overrides={"block_tokens": 16, "cache_dir": str(tmp_path / "node-cache")}, environ={})
    served = profile_for(vllm_config(str(checkpoint)), config)  # type: ignore[arg-type]
    assert served.revision.startswith("content-")
    assert not (checkpoint / REVISION_FILE).exists()
    assert len(list((tmp_path / "node-cache" / "revisions").iterdir())) == 1


def test_the_node_hands_vllm_a_hub_models_snapshot(hub):
    from worker.node import NodeRuntime

    node = NodeRuntime(load_config(overrides={"model": "org/tiny", "engine": "vllm"}, environ={}))
    assert node.checkpoint() == hub.resolve()
    absent = NodeRuntime(load_config(overrides={"model": "org/absent", "engine": "vllm"}, environ={}))
    with pytest.raises(ValueError, match=r"org/absent is not in the Hugging Face hub cache .*hf download org/absent"):
        absent.checkpoint()
    unknown = NodeRuntime(load_config(overrides={"model": "no-such-model", "engine": "vllm"}, environ={}))
    with pytest.raises(ValueError, match="'no-such-model' is neither a preset"):
        unknown.checkpoint()


# -- what vLLM runs differently from the checkpoint ----------------------------------------------------
def served(checkpoint: Path, **engine_args: object) -> ModelProfile:
    """The profile the connector keys a checkpoint by, as vLLM's own model config describes the
    server `engine_args` start (vLLM's EngineArgs: --hf-overrides, --max-model-len, ...)."""
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **engine_args)  # type: ignore[arg-type]
    config = load_config(overrides={"block_tokens": 16}, environ={})
    vllm = SimpleNamespace(
        model_config=model_config.create_model_config(), cache_config=SimpleNamespace(cache_dtype="auto")
    )
    return profile_for(vllm, config)  # type: ignore[arg-type]


ROPE_THETA = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}


def test_a_config_override_keys_the_blocks_apart_and_equal_flags_share_them(tmp_path):
    checkpoint = save_preset("tiny", tmp_path / "ckpt")
    plain = served(checkpoint)
    assert plain == load_model(str(checkpoint), device="cpu").profile(16)  # as the engine keys it
    overridden = served(checkpoint, hf_overrides=ROPE_THETA)
    assert overridden.revision.startswith(plain.revision + "+runtime-")
    assert model_key(overridden) != model_key(plain)
    assert served(checkpoint, hf_overrides=ROPE_THETA) == overridden  # the same flags: the same key
    other = served(checkpoint, hf_overrides={"rope_parameters": {"rope_theta": 40000.0, "rope_type": "default"}})
    assert model_key(other) not in (model_key(plain), model_key(overridden))
    assert served(checkpoint, hf_overrides={"rms_norm_eps": 1e-3}).revision != plain.revision


def test_online_quantization_and_a_length_picked_rope_are_keyed_apart():
    on_disk = {
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0},
        "original_max_position_embeddings": 4096,
    }

    def model(**fields: object) -> SimpleNamespace:
        config = SimpleNamespace(to_dict=lambda: dict(on_disk))
        return SimpleNamespace(hf_config=config, quantization=None, max_model_len=4096, **fields)

    assert runtime_settings(model(), on_disk) == {"long_rope": False}  # type: ignore[arg-type]
    longer = model()
    longer.max_model_len = 8192
    assert runtime_settings(longer, on_disk) == {"long_rope": True}  # type: ignore[arg-type]
    quantized = model()
    quantized.quantization = "fp8"
    assert runtime_settings(quantized, on_disk)["quantization"] == "fp8"  # type: ignore[arg-type]
    assert runtime_settings(model(), {**on_disk, "rope_parameters": {"rope_type": "default"}})["hf_config"] == {  # type: ignore[arg-type]
        "rope_parameters": on_disk["rope_parameters"]
    }


# -- the KV caches the connector serves ----------------------------------------------------------------
def kv_config(*groups: tuple[list[str], object]) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in groups],  # type: ignore[arg-type]
    )


LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def spec(kind: str, **extra: object) -> object:
    import vllm.v1.kv_cache_interface as kinds

    shape = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    if kind == "MambaSpec":
        return kinds.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    return getattr(kinds, kind)(**shape, **extra)


def test_full_attention_is_served():
    check_kv_cache(kv_config((LAYERS, spec("FullAttentionSpec"))), "m")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("groups", "named"),
    [
        ([(LAYERS, spec("SlidingWindowSpec", sliding_window=64))], "sliding-window attention layers"),
        ([(LAYERS, spec("FullAttentionSpec", sliding_window=64))], "sliding-window attention (allocated as full"),
        ([(LAYERS, spec("MLAAttentionSpec"))], "multi-head latent attention (MLA) layers"),
        ([(LAYERS, spec("CrossAttentionSpec"))], "cross-attention layers"),
        ([(LAYERS[:2], spec("FullAttentionSpec")), (LAYERS[2:], spec("MambaSpec"))], "Mamba (state-space) layers"),
        (
            [(LAYERS[:2], spec("FullAttentionSpec")), (LAYERS[2:], spec("FullAttentionSpec"))],
            "its layers in 2 KV cache groups",
        ),
    ],
)
def test_any_other_kv_cache_is_refused_at_start_naming_the_layer_kind_and_the_model(groups, named):
    with pytest.raises(ValueError, match=re.escape(named)) as refused:
        check_kv_cache(kv_config(*groups), "/models/some-model")  # type: ignore[arg-type]
    message = str(refused.value)
    assert "/models/some-model" in message and "\n" not in message and "model.layers." in message
