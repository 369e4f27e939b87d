"""The multi-hop fixture model: bindings take their value from another passage, so fused KV without
recompute loses answers and the default r (at the default check layer) wins them back, as its
quality.json documents."""

from __future__ import annotations

import json

import pytest

from benchmarks.models import blend as blend_model
from benchmarks.models import multihop as blend_multihop
from tests.blend.conftest import MULTIHOP_MODEL
from worker.dataplane.blend.options import BlendOptions

pytestmark = pytest.mark.skipif(
    not (MULTIHOP_MODEL / "config.json").exists(),
    reason="the trained multi-hop fixture model is missing (python -m benchmarks.models.multihop train)",
)

DEFAULT = BlendOptions()
DEFAULT_VARIANT = f"{blend_model.SELECTION_PREFIX[DEFAULT.selection]}_r{DEFAULT.recompute_percent:g}"


@pytest.fixture(scope="module")
def documented() -> dict:
    return json.loads((MULTIHOP_MODEL / "quality.json").read_text())


@pytest.fixture(scope="module")
def measured(documented) -> dict:
    # The documented run's questions, on the variants that decide the checks (the others are in the report).
    arguments = {**documented["arguments"], "percents": sorted({0.0, DEFAULT.recompute_percent})}
    arguments["selections"] = [DEFAULT.selection]
    return blend_model.quality_report(MULTIHOP_MODEL, **arguments)


def test_the_fixture_is_small_and_in_safetensors():
    weights = MULTIHOP_MODEL / "model.safetensors"
    assert weights.exists() and weights.stat().st_size < 8 * 1024 * 1024


def test_the_report_covers_every_r_and_selection(documented):
    report = documented["report"]
    assert "fused" in report
    for prefix in blend_model.SELECTION_PREFIX.values():
        for percent in blend_model.PERCENTS:
            assert f"{prefix}_r{percent:g}" in report


def test_accuracy_is_as_documented(documented, measured):
    for variant, row in measured.items():
        # The same seeded questions on the same weights: equal up to floating-point ties (1 question).
        assert row["accuracy"] == pytest.approx(
            documented["report"][variant]["accuracy"], abs=1.01 / documented["arguments"]["questions"]
        ), variant


def test_full_prefill_answers(measured):
    assert measured["full"]["accuracy"] >= 0.95


def test_prefix_only_reuse_is_exact(measured):
    assert measured["prefix_only"]["accuracy"] == measured["full"]["accuracy"]
    assert measured["prefix_only"]["kl"] < 1e-6


def test_fused_kv_without_recompute_loses_answers(measured):
    """The bindings' KV was computed after other passages: fused at every layer, nothing
    recomputed, it holds other values."""
    assert measured["full"]["accuracy"] - measured["fused"]["accuracy"] >= 0.10
    assert measured["fused"]["recomputed_tokens"] == 0
    passages = blend_multihop.MAX_PASSAGES * blend_multihop.PASSAGE_TOKENS
    assert measured["fused"]["reused_tokens"] >= 0.9 * passages, passages


def test_the_default_r_wins_them_back(measured):
    assert measured["full"]["accuracy"] - measured[DEFAULT_VARIANT]["accuracy"] <= 0.02
    assert measured[DEFAULT_VARIANT]["kl"] < measured["fused"]["kl"]


def test_training_is_reproducible(tmp_path):
    """A few steps stand for the recipe: the same seed, the same weights."""
    first = blend_multihop.train(tmp_path / "a", steps=2, log_every=1)
    again = blend_multihop.train(tmp_path / "b", steps=2, log_every=1)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first["final_loss"] == again["final_loss"]
    recorded = json.loads((MULTIHOP_MODEL / "training.json").read_text())
    assert recorded["seed"] == blend_multihop.SEED and recorded["torch"]


def test_a_bad_check_layer_is_refused_before_anything_runs(capsys):
    before = (MULTIHOP_MODEL / "quality.json").read_bytes()
    with pytest.raises(SystemExit):
        blend_model.main(["quality", "--task", "multihop", "--check-layer", "0", "--save"])
    assert "--check-layer: check_layer: must be an integer of at least 1, got 0" in capsys.readouterr().err
    assert (MULTIHOP_MODEL / "quality.json").read_bytes() == before
