"""A node's traffic: the meter that counts it, the summary the heartbeat carries, the row it leaves."""

from __future__ import annotations

import pytest

from controlplane.directory.models import NodeTraffic
from controlplane.directory.services import TierReport, node_heartbeat
from worker.dataplane.traffic import PROMPT_BUCKETS, TrafficMeter, TrafficSummary, bucket_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_bounds():
    assert bucket_of(0) == 0 and bucket_of(127) == 0 and bucket_of(128) == 1
    assert bucket_of(2047) == 4 and bucket_of(2048) == 5
    assert bucket_of(10**6) == len(PROMPT_BUCKETS)


def test_meter_counts_over_a_sliding_window():
    clock = Clock()
    pressure = [0.25]
    meter = TrafficMeter(window_seconds=60, pressure=lambda: pressure[0], clock=clock)
    for tokens in (100, 300, 3000):
        meter.arrive(tokens)
    meter.finish()
    s = meter.summary()
    assert (s.requests, s.prompt_tokens, s.queue_depth, s.l1_pressure) == (3, 3400, 2, 0.25)
    assert s.prompt_buckets[0] == 1 and s.prompt_buckets[2] == 1 and s.prompt_buckets[5] == 1
    assert s.prompts_at_least(2048) == 1 and s.prompts_at_least(256) == 2
    clock.now += 30
    meter.arrive(5000)
    clock.now += 31  # the first three leave the window
    pressure[0] = 1.7  # clamped
    s = meter.summary()
    assert (s.requests, s.prompt_tokens, s.queue_depth, s.l1_pressure) == (1, 5000, 3, 1.0)
    for _ in range(5):
        meter.finish()
    assert meter.summary().queue_depth == 0


def test_meter_rejects_bad_input():
    with pytest.raises(ValueError, match="window_seconds: must be above zero"):
        TrafficMeter(window_seconds=0)
    with pytest.raises(ValueError, match="prompt_tokens: cannot be negative"):
        TrafficMeter().arrive(-1)


def summary(**changes):
    data = {
        "window_seconds": 60.0,
        "requests": 3,
        "prompt_tokens": 900,
        "prompt_buckets": [1, 1, 1] + [0] * 7,
        "queue_depth": 1,
        "l1_pressure": 0.5,
    }
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window_seconds": 0}, "traffic.window_seconds: must be a number above zero"),
        ({"requests": -1}, "traffic.requests: must be a whole number"),
        ({"queue_depth": 1.5}, "traffic.queue_depth: must be a whole number"),
        ({"prompt_buckets": [1, 2]}, "traffic.prompt_buckets: expected 10 whole numbers"),
        ({"prompt_buckets": [4] + [0] * 9}, "traffic.prompt_buckets: counts add up to 4, not requests 3"),
        ({"prompt_buckets": "abc"}, "traffic.prompt_buckets: expected a list"),
        ({"l1_pressure": 2}, r"traffic.l1_pressure: expected a fraction in \[0, 1\]"),
        ({"extra": 1}, "traffic.extra: unknown field"),
    ],
)
def test_summary_from_dict_names_the_bad_field(changes, message):
    with pytest.raises(ValueError, match=message):
        TrafficSummary.from_dict(summary(**changes))


def test_summary_round_trip_and_missing_field():
    s = TrafficSummary.from_dict(summary())
    assert TrafficSummary.from_dict(s.as_dict()) == s
    data = summary()
    del data["requests"]
    with pytest.raises(ValueError, match="traffic.requests: missing"):
        TrafficSummary.from_dict(data)
    with pytest.raises(ValueError, match="long_prompt_tokens: must be one of 128"):
        s.prompts_at_least(1000)


@pytest.mark.django_db(transaction=True)
def test_heartbeat_stores_the_latest_traffic_and_drops_it_when_absent():
    tiers = [TierReport(tier="device", capacity_bytes=1 << 30, used_bytes=0)]
    node_heartbeat(name="n1", host="h", heartbeat_seconds=5, tiers=tiers, traffic=TrafficSummary.from_dict(summary()))
    row = NodeTraffic.objects.get(node__name="n1")
    assert (row.requests, row.prompt_tokens, row.queue_depth, row.l1_pressure) == (3, 900, 1, 0.5)
    assert row.prompt_buckets == [1, 1, 1] + [0] * 7
    later = TrafficSummary.from_dict(summary(requests=1, prompt_buckets=[0] * 9 + [1], prompt_tokens=40000))
    node_heartbeat(name="n1", host="h", heartbeat_seconds=5, tiers=tiers, traffic=later)
    row.refresh_from_db()
    assert (row.requests, row.prompt_buckets[-1]) == (1, 1)
    assert NodeTraffic.objects.count() == 1
    node_heartbeat(name="n1", host="h", heartbeat_seconds=5, tiers=tiers)
    assert not NodeTraffic.objects.exists()
