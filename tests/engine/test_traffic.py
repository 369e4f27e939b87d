"""The engine meters its traffic for the heartbeat: arrivals, prompt lengths, requests in flight
and the device working set's pressure."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine_for


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(length - 1)]


def test_generate_is_metered_with_l1_pressure(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("device", "host")))
    assert engine.traffic.summary().requests == 0
    for length, seed in ((40, 1), (150, 2), (300, 3)):
        engine.generate(prompt_of(length, seed), max_tokens=2)
    summary = engine.traffic.summary()
    assert (summary.requests, summary.prompt_tokens, summary.queue_depth) == (3, 490, 0)
    assert summary.prompt_buckets[0] == 1 and summary.prompt_buckets[1] == 1 and summary.prompt_buckets[2] == 1
    assert engine.working_set is not None and engine.working_set.used_bytes() > 0
    assert summary.l1_pressure == pytest.approx(engine.working_set.used_bytes() / engine.working_set.capacity_bytes)
    assert 0 < summary.l1_pressure <= 1


def test_a_failed_request_leaves_the_queue(models, make_store):
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(prompt_of(20, 4), max_tokens=0)  # refused before it arrives
    assert engine.traffic.summary().requests == 0
    engine.generate(prompt_of(20, 4), max_tokens=1)
    summary = engine.traffic.summary()
    assert (summary.requests, summary.queue_depth, summary.l1_pressure) == (1, 0, 0.0)
