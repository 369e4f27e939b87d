"""Load-following against PostgreSQL and Redis: a day's traffic shape replayed in simulated minutes
through the real heartbeat service, the switches it makes (policy versions, reasons, dashboard
events on the real channel layer), the holds of manual and scheduled switches, and the REST API."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from controlplane.celery_app import app as celery
from controlplane.directory.services import TierReport, node_heartbeat
from controlplane.events import DASHBOARD_GROUP, event_validate
from controlplane.policies import following, tasks
from controlplane.policies.choices import LOAD_FOLLOW_TASK
from controlplane.policies.following import load_follow, loadfollowing_resume, loadfollowing_update
from controlplane.policies.models import Mode, PolicyVersion
from controlplane.policies.services import mode_activate, policy_rollback
from worker.dataplane.traffic import PROMPT_BUCKETS, TrafficSummary

pytestmark = pytest.mark.django_db
NODES = ("gpu-a", "gpu-b", "gpu-c")


def traffic(rpm: int, *, long: float = 0.0, l1: float = 0.5, queue: int = 0) -> TrafficSummary:
    """One node's minute: `rpm` requests, a share `long` of them 5000-token documents, the rest
    300-token chat turns."""
    longs = round(rpm * long)
    buckets = [0] * (len(PROMPT_BUCKETS) + 1)
    buckets[2] = rpm - longs  # 256-511 tokens
    buckets[6] = longs  # 4096-8191 tokens
    return TrafficSummary(
        window_seconds=60.0,
        requests=rpm,
        prompt_tokens=300 * (rpm - longs) + 5000 * longs,
        prompt_buckets=tuple(buckets),
        queue_depth=queue,
        l1_pressure=l1,
    )


def report(at, summary: TrafficSummary) -> None:
    for name in NODES:
        node_heartbeat(
            name=name,
            host="host-" + name,
            heartbeat_seconds=5.0,
            tiers=[TierReport(tier="device", capacity_bytes=1 << 30, used_bytes=int(summary.l1_pressure * (1 << 30)))],
            traffic=summary,
            now=at,
        )


class Dashboard:
    """A consumer of the dashboard group on the real (Redis) channel layer."""

    def __init__(self) -> None:
        self.layer = get_channel_layer()
        self.channel = async_to_sync(self.layer.new_channel)()
        async_to_sync(self.layer.group_add)(DASHBOARD_GROUP, self.channel)

    def drain(self) -> list[dict]:
        async def read() -> list[dict]:
            events = []
            while True:
                try:
                    message = await asyncio.wait_for(self.layer.receive(self.channel), timeout=0.5)
                except TimeoutError:
                    return events
                events.append(message["event"])

        return async_to_sync(read)()

    def close(self) -> None:
        async_to_sync(self.layer.group_discard)(DASHBOARD_GROUP, self.channel)


@pytest.fixture
def dashboard():
    consumer = Dashboard()  # read once, at the end (the layer's queues belong to one event loop)
    yield consumer
    consumer.close()


@pytest.fixture
def enabled(db):
    return loadfollowing_update(enabled=True, min_dwell_seconds=600, manual_hold_seconds=1800, author="ops")


# A day, one sample a simulated minute: (minutes, per-node traffic). Three nodes report each.
DAY = [
    (5, traffic(80, l1=0.7, queue=3)),  # morning chat burst: 240 req/min across the fleet
    (3, traffic(32, l1=0.6)),  # a dip to 96 req/min: under the enter, over the leave threshold
    (22, traffic(90, l1=0.8, queue=4)),
    (5, traffic(20, long=0.7, l1=0.9, queue=1)),  # long documents: 70% of prompts ≥ 2048 tokens
    (4, traffic(80)),  # a chat flurry within the long-doc dwell: waits
    (21, traffic(20, long=0.75, l1=0.9, queue=1)),
    (30, traffic(1, l1=0.1)),  # night: 3 req/min, nothing queued
]


def test_a_day_replayed_switches_with_reasons_versions_and_events(
    enabled, dashboard, sent_tasks, django_capture_on_commit_callbacks
):
    start = timezone.now()
    first_version = PolicyVersion.objects.order_by("-number").first().number
    actions: list[tuple[int, str, str]] = []
    minute = 0
    with django_capture_on_commit_callbacks(execute=True):
        for minutes, summary in DAY:
            for _ in range(minutes):
                at = start + timedelta(minutes=minute)
                report(at, summary)
                result = load_follow(now=at)
                actions.append((minute, result.action, result.target))
                minute += 1
        # The nodes stop reporting: after the window their traffic no longer counts.
        quiet = load_follow(now=start + timedelta(minutes=minute + 4))
    switches = [(m, target) for m, action, target in actions if action == "switched"]
    assert switches == [(0, "chat-peak"), (30, "long-doc"), (60, "nightly-batch")]
    # Hysteresis: the dip to 96 req/min kept chat-peak; the dwell held long-doc through the flurry.
    assert {a for m, a, _ in actions if 5 <= m < 8} == {"stay"}
    assert [(a, t) for m, a, t in actions if 35 <= m < 39] == [("wait", "chat-peak")] * 4
    assert {a for m, a, _ in actions if 39 <= m < 60} == {"stay"}
    assert quiet.action == "no-traffic"
    assert Mode.objects.get(active=True).name == "nightly-batch"

    versions = list(PolicyVersion.objects.filter(number__gt=first_version).order_by("number"))
    assert [(v.action, v.author, v.snapshot["active_mode"]) for v in versions] == [
        ("mode.switch", "load-following", "chat-peak"),
        ("mode.switch", "load-following", "long-doc"),
        ("mode.switch", "load-following", "nightly-batch"),
    ]
    assert versions[0].comment == (
        "load-following: 240 req/min, 100% prompts < 2048 tokens (mean 300), L1 70%, queue 9, 3 node(s) → chat-peak"
    )
    assert versions[1].comment.startswith("load-following: 60 req/min, 30% prompts < 2048 tokens (mean 3590)")
    assert versions[1].comment.endswith("→ long-doc")
    assert versions[2].comment.startswith("load-following: 3 req/min, 100% prompts < 2048 tokens")
    assert versions[2].comment.endswith("queue 0, 3 node(s) → nightly-batch")

    events = dashboard.drain()
    for event in events:
        event_validate(event)
    followed = [e["payload"] for e in events if e["type"] == "mode.followed"]
    assert followed == [
        {"mode": "chat-peak", "previous": "", "version": versions[0].number, "reason": versions[0].comment},
        {"mode": "long-doc", "previous": "chat-peak", "version": versions[1].number, "reason": versions[1].comment},
        {"mode": "nightly-batch", "previous": "long-doc", "version": versions[2].number, "reason": versions[2].comment},
    ]
    switched = [e["payload"]["mode"] for e in events if e["type"] == "mode.switched"]
    assert switched == ["chat-peak", "long-doc", "nightly-batch"]
    # The planner and nodes heard of each switch as of any other.
    assert [kwargs["reason"] for name, kwargs, _ in sent_tasks if name == "movements.plan"][:3] == ["mode-switch"] * 3


def test_back_to_no_mode_when_traffic_fits_none(enabled, sent_tasks):
    now = timezone.now()
    report(now, traffic(80))
    assert load_follow(now=now).target == "chat-peak"
    later = now + timedelta(minutes=11)
    report(later, traffic(10))  # 30 req/min: neither busy nor quiet
    result = load_follow(now=later)
    assert (result.action, result.target) == ("switched", "")
    assert not Mode.objects.filter(active=True).exists()
    assert PolicyVersion.objects.order_by("-number").first().comment.endswith("→ no mode")


def test_disabled_by_default_and_nothing_switches(sent_tasks):
    report(timezone.now(), traffic(100))
    before = PolicyVersion.objects.count()
    assert load_follow().action == "disabled"
    assert PolicyVersion.objects.count() == before


def test_a_manual_switch_holds_until_its_hold_ends(enabled, sent_tasks):
    version = mode_activate(name="long-doc", author="ops", comment="big import")
    at = version.created_at + timedelta(minutes=10)
    report(at, traffic(80))
    held = load_follow(now=at)
    assert held.action == "held"
    assert held.reason.startswith(f"load-following held by a manual switch by ops (v{version.number}) until ")
    assert Mode.objects.get(active=True).name == "long-doc"
    after = version.created_at + timedelta(minutes=31)
    report(after, traffic(80))
    result = load_follow(now=after)
    assert (result.action, result.target) == ("switched", "chat-peak")


def test_a_rollback_holds_like_a_manual_switch(enabled, sent_tasks):
    version = policy_rollback(version=1, author="ops")
    at = version.created_at + timedelta(minutes=1)
    report(at, traffic(80))
    held = load_follow(now=at)
    assert held.action == "held" and f"manual switch by ops (v{version.number})" in held.reason


def test_resume_ends_a_hold_at_once(enabled, sent_tasks):
    mode_activate(name="long-doc", author="ops")
    now = timezone.now() + timedelta(seconds=1)
    report(now, traffic(80))
    assert load_follow(now=now).action == "held"
    loadfollowing_resume(author="ops", now=now)
    assert load_follow(now=now + timedelta(seconds=1)).target == "chat-peak"
    assert Mode.objects.get(active=True).name == "chat-peak"


def test_a_scheduled_switch_holds_for_the_schedule_window(enabled, sent_tasks):
    loadfollowing_update(schedule_hold_seconds=120)
    assert tasks.mode_switch("nightly-batch") is not None  # what a schedule's beat entry runs
    switched = PolicyVersion.objects.order_by("-number").first()
    at = switched.created_at + timedelta(seconds=60)
    report(at, traffic(80))
    held = load_follow(now=at)
    assert held.action == "held" and "by a scheduled switch" in held.reason
    at = switched.created_at + timedelta(seconds=121)
    report(at, traffic(80))
    assert load_follow(now=at).target == "chat-peak"


def test_beat_runs_the_check_every_minute(enabled, sent_tasks):
    entry = PeriodicTask.objects.get(name="policies: load-following")
    assert (entry.task, entry.interval.every, entry.interval.period, entry.queue) == (
        LOAD_FOLLOW_TASK,
        60,
        "seconds",
        "control",
    )
    assert LOAD_FOLLOW_TASK in celery.tasks
    report(timezone.now(), traffic(80))
    assert tasks.load_follow() == "switched"
    assert following.loadfollowing_get().mode == "chat-peak"


def test_a_missing_mode_of_the_kind_is_reported(enabled, sent_tasks):
    Mode.objects.filter(kind="chat-peak").update(kind="custom")
    report(timezone.now(), traffic(80))
    result = following.load_follow()
    assert result.action == "no-mode" and result.reason.endswith("but no mode of kind chat-peak exists")


# -- REST ------------------------------------------------------------------------------------------

URL = "/api/v1/load-following/"


def test_viewers_read_operators_write(api_as, throttle_cache):
    viewer, operator = api_as("viewer"), api_as("operator")
    body = viewer.get(URL).json()
    assert body["enabled"] is False and body["min_dwell_seconds"] == 600 and body["held"] == ""
    assert viewer.patch(URL, {"enabled": True}, format="json").status_code == 403
    assert viewer.post(URL + "resume/").status_code == 403
    assert api_as("anonymous").get(URL).status_code in (401, 403)
    response = operator.patch(URL, {"enabled": True, "chat_enter_rpm": 150, "long_prompt_tokens": 4096}, format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["enabled"], body["chat_enter_rpm"], body["long_prompt_tokens"]) == (True, 150, 4096)
    assert body["author"].startswith("u-operator")
    response = operator.post(URL + "resume/")
    assert response.status_code == 200 and response.json()["resumed_at"]


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"chat_leave_rpm": 500}, "chat_leave_rpm", "must not exceed chat_enter_rpm"),
        ({"long_prompt_tokens": 1000}, "long_prompt_tokens", "must be one of 128"),
        ({"long_enter_share": 2}, "long_enter_share", "expected a fraction"),
        ({"window_seconds": 0}, "window_seconds", "must be above zero"),
        ({"manual_hold_seconds": -5}, "manual_hold_seconds", "cannot be negative"),
        ({"enabled": "maybe"}, "enabled", "valid boolean"),
        ({"min_dwell_seconds": "soon"}, "min_dwell_seconds", "valid number"),
        ({"mode": "chat-peak", "": 1}, "non_field_errors", "not load-following settings: '', 'mode'"),
    ],
)
def test_bad_settings_are_400_naming_the_field(api_as, throttle_cache, body, field, message):
    response = api_as("operator").patch(URL, body, format="json")
    assert response.status_code == 400
    errors = response.json()
    assert field in errors and message in " ".join(errors[field]), errors
    assert api_as("viewer").get(URL).json()["enabled"] is False  # nothing stored
