"""Auto-tune and fallback: poor agreement with full prefill raises r, then falls back to prefix-only."""

from __future__ import annotations

import pytest
import torch

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.blend.options import BlendError, BlendOptions, parse_namespace_percents
from worker.dataplane.blend.tuner import PREFIX_ONLY, BlendTuner, agreement
from worker.dataplane.counters import Counters


def stored_passage_prompt(engine, seed: int) -> list[int]:
    passage = tokens(3 * BLOCK_TOKENS, seed=seed)
    engine.generate([1, *tokens(7, seed=seed + 1), *passage, 2], max_tokens=1, segments=[[8, 8 + len(passage)]])
    return [1, *tokens(13, seed=seed + 2), *passage, *tokens(5, seed=seed + 3)]


def test_poor_agreement_raises_r_then_falls_back_to_prefix_only(models):
    """With a KL bound no fused answer can meet (random weights, r < 100%), every sampled request
    disagrees: r climbs by its step to the ceiling, then the namespace falls back."""
    model = models("tiny")
    engine = blend_engine(
        model, recompute_percent=10, sample_rate=1.0, min_samples=3, max_kl=1e-12, raise_step_percent=20, max_percent=30
    )
    prompt = stored_passage_prompt(engine, seed=1)
    seen = []
    for _ in range(12):
        result = engine.generate(prompt, max_tokens=1, write_back=False)
        seen.append((result.trace.blend, result.trace.blend_percent))
        assert engine.tuner.drain(timeout=60)
    assert seen[0] == ("blend", 10.0)
    assert ("blend", 30.0) in seen
    state = engine.tuner.state("default")
    assert state.mode == PREFIX_ONLY and state.percent == 30.0 and state.raised == 1
    assert seen[-1] == ("prefix-only", 30.0)
    last = engine.generate(prompt, max_tokens=4, write_back=False)
    assert last.trace.fragment_tokens == 0 and last.trace.blend == "prefix-only"
    cold = engine.generate(prompt, max_tokens=4, use_cache=False)
    assert last.output_ids == cold.output_ids
    counts = engine.counters.snapshot()
    assert counts["blend.samples_disagreed"] == 6 and counts["blend.ratio_raised"] == 1
    assert counts["blend.fallbacks"] == 1
    # An operator can resume blending at a chosen r.
    engine.tuner.set_percent("default", 50)
    assert engine.generate(prompt, max_tokens=1, write_back=False).trace.blend == "blend"
    engine.close()


def test_good_agreement_keeps_r(models):
    model = models("tiny")
    engine = blend_engine(model, recompute_percent=100, sample_rate=1.0, min_samples=2)
    prompt = stored_passage_prompt(engine, seed=2)
    for _ in range(4):
        engine.generate(prompt, max_tokens=1, write_back=False)
        assert engine.tuner.drain(timeout=60)
    state = engine.tuner.state("default")
    assert state.mode == "blend" and state.percent == 100 and state.agreed == state.samples == 4
    engine.close()


def test_namespaces_are_tuned_apart():
    tuner = BlendTuner(
        options=BlendOptions(
            enabled=True, namespace_percent={"rag": 5.0}, min_samples=1, raise_step_percent=10, max_percent=20
        ),
        full_prefill=lambda prompt: torch.zeros(4),
        counters=Counters(),
        model="m",
    )
    assert tuner.current("rag") == ("blend", 5.0) and tuner.current("chat") == ("blend", 15.0)
    tuner.record("rag", agree=False, kl=1.0, percent=5.0)
    assert tuner.current("rag") == ("blend", 15.0) and tuner.current("chat") == ("blend", 15.0)
    # A sample judged under an r that has changed since does not count.
    tuner.record("rag", agree=False, kl=1.0, percent=5.0)
    assert tuner.current("rag") == ("blend", 15.0)
    tuner.record("rag", agree=False, kl=1.0, percent=15.0)
    tuner.record("rag", agree=False, kl=1.0, percent=20.0)
    assert tuner.current("rag") == ("prefix-only", 20.0)


def test_agreement_compares_greedy_token_and_kl():
    same, kl = agreement(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 3.0, 1.0]))
    assert same and kl == pytest.approx(0.0, abs=1e-7)
    same, kl = agreement(torch.tensor([5.0, 0.0, 0.0]), torch.tensor([0.0, 5.0, 0.0]))
    assert not same and kl > 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"recompute_percent": 101}, "recompute_percent"),
        ({"recompute_percent": -1}, "recompute_percent"),
        ({"recompute_percent": "ten"}, "recompute_percent"),
        ({"namespace_percent": {"rag": 150}}, "namespace_percent[rag]"),
        ({"selection": "random"}, "selection"),
        ({"check_layer": 0}, "check_layer"),
        ({"sample_rate": 2}, "sample_rate"),
        ({"max_percent": 120}, "max_percent"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(BlendError) as caught:
        BlendOptions(**kwargs)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_operator_r_is_checked(models):
    engine = blend_engine(models("tiny"))
    with pytest.raises(BlendError, match="recompute_percent: must be between 0 and 100"):
        engine.tuner.set_percent("default", 140)
    assert engine.tuner.current("default") == ("blend", 15.0)


def test_namespace_percent_pairs():
    assert parse_namespace_percents("rag=5, contracts=30") == {"rag": 5.0, "contracts": 30.0}
    with pytest.raises(BlendError, match=r"blend_namespace_percent\[rag\]: must be between 0 and 100"):
        parse_namespace_percents("rag=120")
    with pytest.raises(BlendError, match="expected namespace=percent pairs"):
        parse_namespace_percents("rag")


def test_a_check_layer_past_the_model_is_refused(models):
    with pytest.raises(ValueError, match="blend: check_layer 2 is past the model's 2 layers"):
        blend_engine(models("tiny"), check_layer=2)


def test_node_options_carry_blend_settings():
    from worker.dataplane.config import ConfigError, load_config

    config = load_config(
        environ={
            "STRATA_BLEND": "true",
            "STRATA_BLEND_RECOMPUTE_PERCENT": "5",
            "STRATA_BLEND_NAMESPACE_PERCENT": "contracts=30",
        }
    )
    options = BlendOptions.from_config(config)
    assert options.enabled and options.percent_for("rag") == 5.0 and options.percent_for("contracts") == 30.0
    with pytest.raises(ConfigError, match="STRATA_BLEND_RECOMPUTE_PERCENT: must be between 0 and 100 percent"):
        load_config(environ={"STRATA_BLEND_RECOMPUTE_PERCENT": "101"})
    with pytest.raises(ConfigError, match=r"STRATA_BLEND_NAMESPACE_PERCENT: blend_namespace_percent\[rag\]"):
        load_config(environ={"STRATA_BLEND_NAMESPACE_PERCENT": "rag=-3"})


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def falling_back_tuner(clock: Clock, **options: object) -> BlendTuner:
    """A tuner already at its ceiling: one poor sample falls namespace `rag` back."""
    settings: dict[str, object] = {
        "enabled": True,
        "recompute_percent": 40,
        "max_percent": 40,
        "min_samples": 1,
        "reprobe_seconds": 60,
    }
    settings.update(options)
    return BlendTuner(
        options=BlendOptions(**settings),
        full_prefill=lambda prompt: torch.zeros(4),  # type: ignore[arg-type]
        counters=Counters(),
        model="m",
        clock=clock,
    )


def test_a_fallback_probes_blending_again_after_the_cooldown_and_backs_off():
    clock = Clock()
    tuner = falling_back_tuner(clock)
    tuner.record("rag", agree=False, kl=1.0, percent=40.0)
    assert tuner.current("rag") == ("prefix-only", 40.0)
    assert tuner.snapshot()["rag"]["reprobe_in_s"] == 60.0
    clock.now += 59
    assert tuner.current("rag") == ("prefix-only", 40.0)
    # A sample judged while prefix-only (queued before the fallback) changes nothing.
    tuner.record("rag", agree=True, kl=0.0, percent=40.0)
    clock.now += 1
    assert tuner.current("rag") == ("blend", 40.0)
    state = tuner.state("rag")
    assert state.probing and not state.window and tuner.counters.get("blend.reprobes") == 1
    # The probe is sampled and judged like any window; failing it doubles the next cooldown.
    tuner.record("rag", agree=False, kl=1.0, percent=40.0)
    assert tuner.current("rag") == ("prefix-only", 40.0)
    assert tuner.snapshot()["rag"]["reprobe_in_s"] == 120.0
    clock.now += 120
    assert tuner.current("rag") == ("blend", 40.0)
    tuner.record("rag", agree=False, kl=1.0, percent=40.0)
    assert tuner.snapshot()["rag"]["reprobe_in_s"] == 240.0
    clock.now += 240
    # A probe that agrees ends the backoff: the next fallback waits one cooldown again.
    tuner.record("rag", agree=True, kl=0.0, percent=40.0)
    assert tuner.current("rag") == ("blend", 40.0) and not tuner.state("rag").probing
    tuner.record("rag", agree=False, kl=1.0, percent=40.0)
    assert tuner.snapshot()["rag"]["reprobe_in_s"] == 60.0
    assert tuner.counters.get("blend.fallbacks") == 4 and tuner.counters.get("blend.reprobes") == 3


def test_the_backoff_is_capped():
    clock = Clock()
    tuner = falling_back_tuner(clock, reprobe_seconds=10)
    waits = []
    for _ in range(7):
        tuner.record("rag", agree=False, kl=1.0, percent=40.0)
        waits.append(tuner.snapshot()["rag"]["reprobe_in_s"])
        clock.now += waits[-1]
    assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, 160.0, 160.0]


def test_reprobe_zero_leaves_the_fallback_to_an_operator():
    clock = Clock()
    tuner = falling_back_tuner(clock, reprobe_seconds=0)
    tuner.record("rag", agree=False, kl=1.0, percent=40.0)
    clock.now += 10**9
    assert tuner.current("rag") == ("prefix-only", 40.0)
    assert tuner.snapshot()["rag"]["reprobe_in_s"] is None
    assert tuner.set_percent("rag", 10)["mode"] == "blend"
    assert tuner.current("rag") == ("blend", 10.0)


def test_an_operator_lowers_r_or_resets_to_the_configured_one():
    clock = Clock()
    tuner = falling_back_tuner(clock, namespace_percent={"m/rag": 30.0}, max_percent=30)
    tuner.record("rag", agree=False, kl=1.0, percent=30.0)
    assert tuner.current("rag") == ("prefix-only", 30.0)
    state = tuner.set_percent("rag", 5)
    assert state["mode"] == "blend" and state["recompute_percent"] == 5.0 and state["reprobe_in_s"] is None
    assert tuner.current("rag") == ("blend", 5.0)
    # From 5% the tuner raises r again by its step when agreement is poor.
    tuner.record("rag", agree=False, kl=1.0, percent=5.0)
    assert tuner.current("rag") == ("blend", 20.0)
    state = tuner.reset("rag")
    assert state["recompute_percent"] == 30.0 and state["samples"] == 0 and state["raised"] == 0
    assert tuner.current("rag") == ("blend", 30.0)
    assert tuner.counters.get("blend.operator_changes") == 2


def test_configured_namespaces_are_known_before_their_first_request():
    tuner = BlendTuner(
        options=BlendOptions(
            enabled=True, model_percent={"m": 12.0}, namespace_percent={"m/rag": 30.0, "chat": 5.0, "other/legal": 50.0}
        ),
        full_prefill=lambda prompt: torch.zeros(4),
        counters=Counters(),
        model="m",
    )
    snapshot = tuner.snapshot()
    assert {name: state["recompute_percent"] for name, state in snapshot.items()} == {"chat": 5.0, "rag": 30.0}
    assert tuner.default_percent == 12.0 and tuner.current("legal") == ("blend", 12.0)
