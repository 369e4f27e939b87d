"""The trained fixture model: its accuracy and the cost of fragment reuse are what its quality.json documents."""

from __future__ import annotations

import json

import pytest

from benchmarks.models import blend as blend_model
from tests.blend.conftest import FIXTURE_MODEL

pytestmark = pytest.mark.skipif(
    not (FIXTURE_MODEL / "config.json").exists(),
    reason="the trained fixture model is missing (python -m benchmarks.models.blend train)",
)


@pytest.fixture(scope="module")
def documented() -> dict:
    return json.loads((FIXTURE_MODEL / "quality.json").read_text())


@pytest.fixture(scope="module")
def measured(documented) -> dict:
    return blend_model.quality_report(FIXTURE_MODEL, **documented["arguments"])


def test_the_fixture_is_small_and_in_safetensors():
    weights = FIXTURE_MODEL / "model.safetensors"
    assert weights.exists() and weights.stat().st_size < 8 * 1024 * 1024


def test_accuracy_is_as_documented(documented, measured):
    for variant, row in documented["report"].items():
        # The same seeded questions on the same weights: equal up to floating-point ties (1 question).
        assert measured[variant]["accuracy"] == pytest.approx(
            row["accuracy"], abs=1.01 / documented["arguments"]["questions"]
        ), variant


def test_the_model_has_learnt_the_task(measured):
    assert measured["full"]["accuracy"] >= 0.9


def test_prefix_only_reuse_is_exact(measured):
    assert measured["prefix_only"]["accuracy"] == measured["full"]["accuracy"]
    assert measured["prefix_only"]["kl"] < 1e-6


def test_more_recompute_means_closer_to_full_prefill(documented, measured):
    kl = [measured[f"blend_r{p}"]["kl"] for p in (0, 5, 15, 30)]
    assert kl[0] >= kl[-1]
    # Every passage was seen before: nearly all of each prompt's passage tokens come from the cache.
    passages = documented["arguments"]["passages"] * blend_model.PASSAGE_TOKENS
    assert all(measured[f"blend_r{p}"]["reused_tokens"] >= 0.9 * passages for p in (0, 30)), passages


def test_blend_costs_at_most_two_points_of_accuracy(measured):
    assert measured["full"]["accuracy"] - measured["blend_r15"]["accuracy"] <= 0.02


def test_training_is_reproducible(tmp_path):
    """The same seed gives the same weights, byte for byte (a few steps stand for the 1,600); another
    seed gives others. The fixture's training.json records the seed and torch build it was made with."""
    first = blend_model.train(tmp_path / "a", steps=3, log_every=1)
    again = blend_model.train(tmp_path / "b", steps=3, log_every=1)
    other = blend_model.train(tmp_path / "c", steps=3, seed=blend_model.SEED + 1, log_every=1)
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b", "c")]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert first["final_loss"] == again["final_loss"] != other["final_loss"]
    recorded = json.loads((FIXTURE_MODEL / "training.json").read_text())
    assert recorded["seed"] == blend_model.SEED and recorded["torch"]
