"""The connector keys the model vLLM serves as Strata's own engine keys it: a checkpoint directory,
a hub id at vLLM's revision (from the local hub cache), or that hub id's snapshot directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.engine.test_checkpoints import COMMIT, OTHER_COMMIT, hub_cache
from worker.dataplane.config import load_config
from worker.dataplane.connectors.vllm.runtime import profile_for
from worker.dataplane.models.checkpoints import REVISION_FILE
from worker.dataplane.models.loading import load_model, save_preset


def vllm_config(model: str, revision: str | None = None) -> SimpleNamespace:
    """The parts of vLLM's config the profile reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, dtype=torch.float32),
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
