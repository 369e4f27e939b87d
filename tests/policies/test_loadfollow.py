"""The load-following classifier: enter/leave thresholds, priorities, dwell, fleet shape."""

from __future__ import annotations

import pytest

from controlplane.policies.loadfollow import (
    CHAT_PEAK,
    LONG_DOC,
    NIGHTLY_BATCH,
    NONE,
    NodeSample,
    Shape,
    Thresholds,
    classify,
    decide,
    describe,
    fleet_shape,
)

T = Thresholds()


def shape(rpm=50.0, long=0.1, mean=300.0, l1=0.3, queue=0.0):
    return Shape(requests_per_min=rpm, long_share=long, mean_prompt_tokens=mean, l1_pressure=l1, queue_depth=queue)


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        (shape(rpm=200), CHAT_PEAK),
        (shape(rpm=120), CHAT_PEAK),
        (shape(rpm=119), NONE),
        (shape(rpm=50, l1=0.9, queue=10), CHAT_PEAK),  # pressure and queue without the rate
        (shape(rpm=50, l1=0.9, queue=2), NONE),
        (shape(rpm=50, l1=0.5, queue=10), NONE),
        (shape(rpm=40, long=0.6), LONG_DOC),
        (shape(rpm=200, long=0.6), LONG_DOC),  # long documents take over a busy fleet
        (shape(rpm=3, long=0.9), NIGHTLY_BATCH),  # too few requests for a long-doc peak
        (shape(rpm=3), NIGHTLY_BATCH),
        (shape(rpm=3, queue=2), NONE),  # work still waiting: not quiet
        (shape(rpm=0, long=0.0, mean=0), NIGHTLY_BATCH),
        (shape(rpm=10), NONE),
    ],
)
def test_classify_from_no_mode_uses_enter_thresholds(s, expected):
    assert classify(s, T, current=NONE) == expected


@pytest.mark.parametrize(
    ("current", "s", "expected"),
    [
        (CHAT_PEAK, shape(rpm=100), CHAT_PEAK),  # below enter, above leave: stays
        (CHAT_PEAK, shape(rpm=79), NONE),
        (CHAT_PEAK, shape(rpm=100, long=0.5), LONG_DOC),
        (CHAT_PEAK, shape(rpm=100, long=0.45), CHAT_PEAK),
        (LONG_DOC, shape(rpm=40, long=0.4), LONG_DOC),  # below enter share, above leave share
        (LONG_DOC, shape(rpm=40, long=0.29), NONE),
        (LONG_DOC, shape(rpm=200, long=0.29), CHAT_PEAK),
        (LONG_DOC, shape(rpm=4, long=0.9), NIGHTLY_BATCH),
        (NIGHTLY_BATCH, shape(rpm=12), NIGHTLY_BATCH),  # above enter, below leave: stays
        (NIGHTLY_BATCH, shape(rpm=16), NONE),
        (NIGHTLY_BATCH, shape(rpm=12, queue=1), NONE),
        (NIGHTLY_BATCH, shape(rpm=300), CHAT_PEAK),
    ],
)
def test_classify_holds_the_current_mode_until_its_leave_threshold(current, s, expected):
    assert classify(s, T, current=current) == expected


def test_hysteresis_does_not_flap_around_a_threshold():
    current = NONE
    seen = []
    for rpm in (125, 118, 122, 100, 121, 90, 81, 79, 85, 119):
        current = classify(shape(rpm=rpm), T, current=current)
        seen.append(current)
    assert seen == [CHAT_PEAK] * 7 + [NONE, NONE, NONE]


def test_classify_unknown_current_kind_names_it():
    with pytest.raises(ValueError, match="kind: unknown mode kind 'turbo'"):
        classify(shape(), T, current="turbo")


def test_decide_switches_and_states_the_shape():
    d = decide(shape(rpm=212, long=0.09, mean=310), T, current=NONE, dwelt_seconds=None)
    assert d.switch and d.target == CHAT_PEAK
    assert d.reason.startswith("load-following: 212 req/min, 91% prompts < 2048 tokens (mean 310)")
    assert d.reason.endswith("→ chat-peak")


def test_decide_waits_for_the_minimum_dwell():
    d = decide(shape(rpm=3), T, current=CHAT_PEAK, dwelt_seconds=120)
    assert (d.target, d.switch) == (NIGHTLY_BATCH, False)
    assert "after the minimum dwell (480 s to go in chat-peak)" in d.reason
    d = decide(shape(rpm=3), T, current=CHAT_PEAK, dwelt_seconds=600)
    assert (d.target, d.switch) == (NIGHTLY_BATCH, True)


def test_decide_no_change_when_the_mode_fits():
    d = decide(shape(rpm=100), T, current=CHAT_PEAK, dwelt_seconds=5)
    assert (d.target, d.switch) == (CHAT_PEAK, False)


def test_describe_no_mode():
    assert describe(shape(rpm=10), T, NONE).endswith("→ no mode")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"chat_enter_rpm": -1}, "chat_enter_rpm: cannot be negative"),
        ({"min_dwell_seconds": -1}, "min_dwell_seconds: cannot be negative"),
        ({"long_enter_share": 1.5}, r"long_enter_share: expected a fraction in \[0, 1\]"),
        ({"pressure_enter": -0.1}, "pressure_enter: expected a fraction"),
        ({"long_prompt_tokens": 0}, "long_prompt_tokens: must be at least 1"),
        ({"chat_leave_rpm": 130}, "chat_leave_rpm: must not exceed chat_enter_rpm"),
        ({"long_leave_share": 0.6}, "long_leave_share: must not exceed long_enter_share"),
        ({"quiet_leave_rpm": 4}, "quiet_leave_rpm: must not be below quiet_enter_rpm"),
        ({"quiet_leave_rpm": 90}, "quiet_leave_rpm: must not exceed chat_leave_rpm"),
    ],
)
def test_thresholds_check_names_the_field(changes, message):
    import dataclasses

    with pytest.raises(ValueError, match=message):
        dataclasses.replace(T, **changes).check()


def test_default_thresholds_are_valid():
    T.check()


def test_fleet_shape_sums_rates_and_weights_prompts():
    s = fleet_shape(
        [
            NodeSample(
                requests=100, window_seconds=60, long_prompts=10, prompt_tokens=30000, l1_pressure=0.8, queue_depth=2
            ),
            NodeSample(
                requests=50, window_seconds=30, long_prompts=40, prompt_tokens=150000, l1_pressure=0.4, queue_depth=1
            ),
        ]
    )
    assert s is not None
    assert s.requests_per_min == pytest.approx(200)
    assert s.long_share == pytest.approx(50 / 150)
    assert s.mean_prompt_tokens == pytest.approx(180000 / 150)
    assert s.l1_pressure == pytest.approx(0.6)
    assert s.queue_depth == 3 and s.nodes == 2


def test_fleet_shape_empty_and_idle():
    assert fleet_shape([]) is None
    s = fleet_shape(
        [NodeSample(requests=0, window_seconds=60, long_prompts=0, prompt_tokens=0, l1_pressure=0, queue_depth=0)]
    )
    assert s == Shape(requests_per_min=0, long_share=0, mean_prompt_tokens=0, l1_pressure=0, queue_depth=0, nodes=1)
    assert classify(s, T) == NIGHTLY_BATCH
