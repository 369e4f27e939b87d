"""Policies services on the real PostgreSQL: seeds, versions, rollback, modes and their schedules,
the snapshot the planner reads under each mode, and what is sent after a change commits."""

from __future__ import annotations

import json
import uuid

import pytest
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from controlplane.celery_app import app as celery
from controlplane.directory.models import Node
from controlplane.directory.services import node_mark_down
from controlplane.policies import dispatch
from controlplane.policies.errors import InUse, PolicyError
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)
from controlplane.policies.selectors import policy_state, policy_state_diff, snapshot_current
from controlplane.policies.services import (
    mode_activate,
    mode_create,
    mode_deactivate,
    mode_delete,
    mode_update,
    modeschedule_create,
    modeschedule_delete,
    modeschedule_update,
    policy_rollback,
    priorityclass_create,
    priorityclass_delete,
    priorityclass_update,
    tierpolicy_create,
    tierpolicy_update,
)
from controlplane.policies.snapshot import policies_snapshot
from controlplane.policies.tasks import mode_switch
from tests.policies.conftest import GiB, node_up

pytestmark = pytest.mark.django_db


def _error(call) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        call()
    return info.value


def test_migrations_seed_the_built_in_policies_as_version_one():
    assert list(PolicyVersion.objects.values_list("number", "action")) == [(1, "policy.seed")]
    assert PolicyVersion.objects.get().snapshot == policy_state()
    assert set(Mode.objects.values_list("name", "kind")) == {
        ("chat-peak", "chat-peak"),
        ("long-doc", "long-doc"),
        ("nightly-batch", "nightly-batch"),
    }
    snap = policies_snapshot()
    assert snap.version == 1 and snap.mode == ""
    assert {c.name: (c.weight, c.device_share) for c in snap.classes} == {"batch": (0.2, 0.3), "default": (1.0, 0.7)}
    assert [t.tier for t in snap.tiers] == ["device", "host", "disk", "remote"]
    host = snap.tier("host")
    assert (host.capacity_bytes, host.high_watermark, host.low_watermark) == (None, 0.9, 0.75)


# -- elastic behaviour: what the planner reads under each mode ---------------------------------------


def test_chat_peak_caps_the_batch_class_share_of_the_device_tier():
    priorityclass_update(priority_class=PriorityClass.objects.get(name="batch"), namespaces=["nightly-jobs"])
    normal = policies_snapshot()
    mode_activate(name="chat-peak", author="tester")
    peak = policies_snapshot()
    assert peak.mode == "chat-peak" and peak.version == normal.version + 1
    device_bytes = 80 * GiB
    normal_cap = normal.class_of_namespace("nightly-jobs").device_share * device_bytes
    peak_cap = peak.class_of_namespace("nightly-jobs").device_share * device_bytes
    assert peak.class_of_namespace("nightly-jobs").name == "batch"
    assert peak_cap == pytest.approx(0.1 * device_bytes) and peak_cap < normal_cap
    # Realtime traffic (the default class) gets the room batch gives up.
    assert peak.class_of_namespace("chat").device_share > normal.class_of_namespace("chat").device_share
    # The stored class is unchanged: the mode only overrides it while active.
    assert PriorityClass.objects.get(name="batch").device_share == 0.3


def test_long_doc_gives_the_host_tier_a_larger_effective_capacity():
    reported = 256 * GiB
    normal = policies_snapshot().tier("host", node_group="default")
    mode_activate(name="long-doc")
    long_doc = policies_snapshot().tier("host", node_group="default")
    assert long_doc.effective_capacity_bytes(reported) > normal.effective_capacity_bytes(reported)
    assert long_doc.high_water_bytes(reported) > normal.high_water_bytes(reported)
    assert long_doc.high_water_bytes(reported) == int(reported * 0.98)
    assert long_doc.capacity_bytes is None


def test_nightly_batch_makes_host_blocks_cold_sooner_and_sends_them_to_remote():
    normal = policies_snapshot().tier("host")
    mode_activate(name="nightly-batch")
    nightly = policies_snapshot().tier("host")
    idle_an_hour = 3600
    assert not normal.is_expired(idle_an_hour) and nightly.is_expired(idle_an_hour)
    assert nightly.demote_tier == "remote"
    reported = 64 * GiB
    assert nightly.high_water_bytes(reported) < normal.high_water_bytes(reported)
    assert nightly.low_water_bytes(reported) < normal.low_water_bytes(reported)
    assert nightly.min_accesses == 0  # moved to remote, never evicted for being used rarely


def test_a_group_policy_wins_over_the_fleet_policy_and_modes_apply_to_it():
    tierpolicy_create(tier="host", node_group="long-context", capacity_fraction=0.8, author="tester")
    snap = policies_snapshot()
    assert snap.tier("host", node_group="long-context").capacity_fraction == 0.8
    assert snap.tier("host", node_group="default").capacity_fraction == 0.5
    mode_update(
        mode=Mode.objects.get(name="long-doc"),
        overrides={"tiers": [{"tier": "host", "node_group": "long-context", "capacity_fraction": 1.0}]},
    )
    mode_activate(name="long-doc")
    snap = policies_snapshot()
    assert snap.tier("host", node_group="long-context").capacity_fraction == 1.0
    assert snap.tier("host", node_group="default").capacity_fraction == 0.5


def test_a_dry_run_proposal_lays_over_the_active_mode_and_is_checked():
    mode_activate(name="chat-peak")
    snap = snapshot_current(overrides={"classes": [{"name": "batch", "device_share": 0.05}]})
    assert snap.mode == "chat-peak" and snap.class_of_namespace("x").name == "default"
    assert {c.name: c.device_share for c in snap.classes}["batch"] == 0.05
    error = _error(lambda: snapshot_current(overrides={"tiers": [{"tier": "host", "low_watermark": 0.95}]}))
    assert error.field == "overrides.tiers[0].low_watermark"


# -- versions and rollback -------------------------------------------------------------------------


def test_every_change_writes_the_next_version_with_the_full_state():
    priorityclass_create(name="interactive", device_share=0.0, weight=5, namespaces=["chat"], author="alice")
    policy = TierPolicy.objects.get(tier="disk", node_group="")
    tierpolicy_update(policy=policy, ttl_seconds=86400, author="bob", comment="keep disk blocks a day")
    mode_create(name="weekend", overrides={"classes": [{"name": "batch", "device_share": 0.25}]}, author="carol")
    mode_activate(name="weekend", author="dave")
    versions = list(PolicyVersion.objects.order_by("number").values_list("number", "action", "author", "comment"))
    assert versions[1:] == [
        (2, "priority-class.create", "alice", "create priority class interactive"),
        (3, "tier-policy.update", "bob", "keep disk blocks a day"),
        (4, "mode.create", "carol", "create mode weekend"),
        (5, "mode.switch", "dave", "switch to mode weekend"),
    ]
    latest = PolicyVersion.objects.get(number=5).snapshot
    assert latest == policy_state() and latest["active_mode"] == "weekend"
    assert {c["name"] for c in latest["classes"]} == {"batch", "default", "interactive"}
    assert next(t for t in latest["tiers"] if t["tier"] == "disk")["ttl_seconds"] == 86400
    # Activating the active mode again changes nothing and writes nothing.
    assert mode_activate(name="weekend") is None
    assert PolicyVersion.objects.count() == 5


def test_rollback_restores_an_earlier_version_as_a_new_one():
    seed = policy_state()
    batch = PriorityClass.objects.get(name="batch")
    priorityclass_update(priority_class=batch, device_share=0.1, namespaces=["jobs"])
    priorityclass_create(name="gold", device_share=0.0, weight=3.0, author="alice")
    tierpolicy_update(policy=TierPolicy.objects.get(tier="host", node_group=""), high_watermark=0.8, low_watermark=0.5)
    mode_delete(mode=Mode.objects.get(name="nightly-batch"))
    mode_activate(name="chat-peak")
    assert policy_state() != seed

    written = policy_rollback(version=1, author="ops")
    assert (written.number, written.action, written.comment, written.author) == (
        7,
        "policy.rollback",
        "rollback to 1",
        "ops",
    )
    assert policy_state() == seed == written.snapshot
    assert not PriorityClass.objects.filter(name="gold").exists()
    assert Mode.objects.filter(name="nightly-batch").exists() and not Mode.objects.filter(active=True).exists()
    # Rolling forward again works the same way.
    policy_rollback(version=6)
    assert policy_state()["active_mode"] == "chat-peak"
    assert PriorityClass.objects.get(name="gold").weight == 3.0


def test_rollback_to_an_unknown_version_names_the_version():
    error = _error(lambda: policy_rollback(version=99))
    assert error.field == "version"
    assert PolicyVersion.objects.count() == 1


def test_diff_between_versions_is_field_level():
    priorityclass_update(priority_class=PriorityClass.objects.get(name="batch"), device_share=0.2)
    priorityclass_create(name="gold", device_share=0.0)
    mode_activate(name="long-doc")
    first, last = PolicyVersion.objects.get(number=1).snapshot, PolicyVersion.objects.get(number=4).snapshot
    changes = {c["path"]: c for c in policy_state_diff(first, last)}
    assert set(changes) == {"classes.batch.device_share", "classes.gold", "active_mode"}
    assert (changes["classes.batch.device_share"]["before"], changes["classes.batch.device_share"]["after"]) == (
        0.3,
        0.2,
    )
    assert changes["classes.gold"]["change"] == "added" and changes["classes.gold"]["after"]["device_share"] == 0.0
    assert (changes["active_mode"]["before"], changes["active_mode"]["after"]) == ("", "long-doc")
    assert policy_state_diff(last, last) == []


# -- validation: each rule names its field and nothing changes -------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (
            lambda: tierpolicy_update(policy=TierPolicy.objects.get(tier="host", node_group=""), low_watermark=0.9),
            "low_watermark",
        ),
        (
            lambda: tierpolicy_update(policy=TierPolicy.objects.get(tier="host", node_group=""), capacity_bytes=-1),
            "capacity_bytes",
        ),
        (
            lambda: tierpolicy_update(policy=TierPolicy.objects.get(tier="host", node_group=""), algorithm="mru"),
            "algorithm",
        ),
        (lambda: tierpolicy_update(policy=TierPolicy.objects.get(tier="host", node_group=""), tier="disk"), "tier"),
        (lambda: tierpolicy_create(tier="host"), "node_group"),
        (lambda: priorityclass_create(name="gold", device_share=0.2), "device_share"),
        (
            lambda: priorityclass_update(priority_class=PriorityClass.objects.get(name="batch"), device_share=0.31),
            "device_share",
        ),
        (lambda: priorityclass_create(name="batch", device_share=0.0), "name"),
        (lambda: priorityclass_create(name="x", device_share=0.0, weight=0), "weight"),
        (
            lambda: mode_create(name="bad", overrides={"tiers": [{"tier": "host", "low_watermark": 0.95}]}),
            "overrides.tiers[0].low_watermark",
        ),
        (
            lambda: mode_create(name="bad", overrides={"classes": [{"name": "batch", "device_share": 0.5}]}),
            "overrides.classes[0].device_share",
        ),
        (
            lambda: mode_create(name="bad", overrides={"tiers": [{"tier": "host", "capacity_bytes": -1}]}),
            "overrides.tiers[0].capacity_bytes",
        ),
        (
            lambda: mode_create(name="bad", overrides={"tiers": [{"tier": "host", "algorithm": "clock"}]}),
            "overrides.tiers[0].algorithm",
        ),
        (lambda: mode_create(name="bad", kind="rush-hour"), "kind"),
        # A base edit that would make a mode invalid is refused too (chat-peak lowers the device low watermark to 0.6).
        (
            lambda: tierpolicy_update(
                policy=TierPolicy.objects.get(tier="device", node_group=""), high_watermark=0.55, low_watermark=0.5
            ),
            "low_watermark",
        ),
        (lambda: mode_activate(name="no-such-mode"), "name"),
        (lambda: mode_deactivate(name="long-doc"), "name"),
        (lambda: modeschedule_create(mode="chat-peak", cron="0 25 * * *"), "cron"),
        (lambda: modeschedule_create(mode="chat-peak", cron="0 8 * *"), "cron"),
        (lambda: modeschedule_create(mode="chat-peak", cron="0 0 31 2 *"), "cron"),
        (lambda: modeschedule_create(mode="no-such-mode", cron="0 8 * * *"), "mode"),
    ],
)
def test_invalid_changes_name_the_field_and_change_nothing(call, field):
    before = policy_state()
    error = _error(call)
    assert error.field == field, error
    assert policy_state() == before
    assert PolicyVersion.objects.count() == 1
    assert not ModeSchedule.objects.exists() and not PeriodicTask.objects.filter(task="policies.mode_switch").exists()


def test_the_default_class_and_the_active_mode_cannot_be_deleted():
    with pytest.raises(InUse):
        priorityclass_delete(priority_class=PriorityClass.objects.get(name="default"))
    mode_activate(name="chat-peak")
    with pytest.raises(InUse):
        mode_delete(mode=Mode.objects.get(name="chat-peak"))
    assert Mode.objects.filter(name="chat-peak", active=True).exists()


# -- schedules and the beat task -------------------------------------------------------------------


def test_a_schedule_owns_a_crontab_beat_entry_running_the_mode_switch():
    schedule = modeschedule_create(mode="nightly-batch", cron="0  1 * * *", author="ops")
    task = PeriodicTask.objects.get(pk=schedule.periodic_task_id)
    assert task.task == "policies.mode_switch" and json.loads(task.kwargs) == {"name": "nightly-batch"}
    assert task.queue == "control" and task.enabled and task.interval is None
    cron = task.crontab
    assert (cron.minute, cron.hour, cron.day_of_month, cron.month_of_year, cron.day_of_week) == (
        "0",
        "1",
        "*",
        "*",
        "*",
    )
    assert str(cron.timezone) == "UTC" and schedule.cron == "0 1 * * *"

    modeschedule_update(schedule=schedule, mode="chat-peak", cron="30 8 * * mon-fri", enabled=False)
    task.refresh_from_db()
    assert json.loads(task.kwargs) == {"name": "chat-peak"} and not task.enabled
    assert (task.crontab.minute, task.crontab.hour, task.crontab.day_of_week) == ("30", "8", "mon-fri")
    assert PeriodicTask.objects.filter(task="policies.mode_switch").count() == 1

    error = _error(lambda: modeschedule_update(schedule=schedule, cron="61 * * * *"))
    assert error.field == "cron"
    task.refresh_from_db()
    assert task.crontab.minute == "30"

    modeschedule_delete(schedule=schedule)
    assert not PeriodicTask.objects.filter(pk=task.pk).exists() and not ModeSchedule.objects.exists()
    assert CrontabSchedule.objects.filter(minute="30", hour="8").exists()  # shared rows stay


def test_deleting_a_mode_deletes_its_schedules_and_beat_entries():
    modeschedule_create(mode="nightly-batch", cron="0 1 * * *")
    mode_delete(mode=Mode.objects.get(name="nightly-batch"))
    assert not ModeSchedule.objects.exists()
    assert not PeriodicTask.objects.filter(task="policies.mode_switch").exists()


def test_the_beat_task_switches_modes_once(sent_tasks):
    schedule = modeschedule_create(mode="nightly-batch", cron="0 1 * * *")
    entry = PeriodicTask.objects.get(pk=schedule.periodic_task_id)
    task = celery.tasks[entry.task]
    assert task.name == "policies.mode_switch"
    assert task.run(**json.loads(entry.kwargs)) == 2
    assert Mode.objects.get(active=True).name == "nightly-batch"
    version = PolicyVersion.objects.get(number=2)
    assert (version.action, version.author) == ("mode.switch", "schedule")
    # A second beat firing the same entry (two beat processes) changes nothing.
    assert mode_switch(name="nightly-batch") is None
    assert PolicyVersion.objects.count() == 2
    # A mode deleted since the schedule was read is logged, not retried.
    assert mode_switch(name="gone") is None


# -- after commit: planner, nodes, dashboard -------------------------------------------------------


def test_a_change_in_force_asks_the_planner_and_every_up_node_after_commit(
    sent_tasks, django_capture_on_commit_callbacks
):
    node_up("gpu-a")
    node_up("gpu-b")
    node_up("gpu-c")
    node_mark_down(name="gpu-c")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        mode_activate(name="chat-peak")
    assert sent_tasks == []  # nothing before the commit
    for callback in callbacks:
        callback()
    assert sent_tasks[0] == ("movements.plan", {"reason": "mode-switch"}, "control")
    assert [queue for _, _, queue in sent_tasks[1:]] == ["node.gpu-a", "node.gpu-b"]
    name, kwargs, _ = sent_tasks[1]
    assert name == "node.apply_policies" and kwargs["version"] == 2
    shares = {c["name"]: c["device_share"] for c in kwargs["classes"]}
    assert shares == {"batch": 0.1, "default": 0.9}
    assert set(kwargs["classes"][0]) == {"name", "weight", "device_share", "namespaces", "remote_write"}
    assert {t["tier"] for t in kwargs["tiers"]} >= {"host"} and kwargs["quotas"] == []

    sent_tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        priorityclass_update(priority_class=PriorityClass.objects.get(name="default"), weight=2.0)
    assert sent_tasks[0] == ("movements.plan", {"reason": "policy-change"}, "control")


def test_an_edit_that_changes_nothing_in_force_sends_nothing(sent_tasks, django_capture_on_commit_callbacks):
    node_up("gpu-a")
    with django_capture_on_commit_callbacks(execute=True):
        mode_update(mode=Mode.objects.get(name="long-doc"), description="bigger host tier")  # not active
        mode_create(name="spare")
    assert sent_tasks == []
    assert PolicyVersion.objects.count() == 3


def test_a_refused_change_sends_nothing(sent_tasks, django_capture_on_commit_callbacks):
    node_up("gpu-a")
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(PolicyError):
            priorityclass_create(name="gold", device_share=0.5)
    assert sent_tasks == []


def test_mode_deactivation_is_a_switch(sent_tasks, django_capture_on_commit_callbacks):
    mode_activate(name="long-doc")
    with django_capture_on_commit_callbacks(execute=True):
        version = mode_deactivate(name="long-doc", author="ops")
    assert version.snapshot["active_mode"] == "" and policies_snapshot().mode == ""
    assert sent_tasks == [("movements.plan", {"reason": "mode-switch"}, "control")]


@pytest.fixture
def broker_queues(monkeypatch):
    """Queue names only this test uses on the real broker, removed afterwards."""
    suffix = uuid.uuid4().hex[:8]
    control = f"control-test-{suffix}"
    monkeypatch.setattr(dispatch, "CONTROL_QUEUE", control)
    names = {"control": control, "node": f"node.policies-{suffix}"}
    yield names
    with celery.connection_for_write() as connection:
        channel = connection.default_channel
        for queue in names.values():
            channel.queue_delete(queue)


def test_dispatch_reaches_the_real_broker(broker_queues):
    node = node_up(broker_queues["node"].removeprefix("node."))
    dispatch.policies_dispatch(
        version=7,
        reason="policy-change",
        classes=[{"name": "default", "weight": 1.0, "device_share": 0.7, "namespaces": []}],
    )
    received = {}
    with celery.connection_for_read() as connection:
        for key, queue_name in broker_queues.items():
            queue = connection.SimpleQueue(queue_name, no_ack=True)
            message = queue.get(timeout=5)
            received[key] = (message.headers["task"], message.payload[1])
            queue.close()
    assert received["control"] == ("movements.plan", {"reason": "policy-change"})
    assert received["node"][0] == "node.apply_policies" and received["node"][1]["version"] == 7
    assert node.queue == broker_queues["node"]


def test_a_broker_that_cannot_be_reached_loses_no_change(monkeypatch, caplog):
    from kombu.exceptions import OperationalError

    class Down:
        def send_task(self, *args, **kwargs):
            raise OperationalError("Error 111 connecting to broker")

    monkeypatch.setattr(dispatch, "celery_app", Down)
    dispatch.policies_dispatch(version=3, reason="policy-change", classes=[])
    assert "policy version 3 saved, but the planner was not told" in caplog.text


def test_changes_announce_versions_and_switches_on_the_dashboard(
    monkeypatch, django_capture_on_commit_callbacks, sent_tasks
):
    from controlplane import events

    seen = []
    monkeypatch.setattr(events, "_send", lambda kind, payload: seen.append((kind, payload)))
    with django_capture_on_commit_callbacks(execute=True):
        mode_activate(name="long-doc", author="ops")
    assert seen == [
        (
            "policy.changed",
            {
                "version": 2,
                "action": "mode.switch",
                "author": "ops",
                "comment": "switch to mode long-doc",
                "mode": "long-doc",
            },
        ),
        ("mode.switched", {"mode": "long-doc", "previous": "", "version": 2, "author": "ops"}),
    ]
    for kind, payload in seen:
        events.event_validate({"type": kind, "seq": 1, "ts": 1.0, "payload": payload})


def test_nodes_report_their_group():
    node = node_up("gpu-g", group="long-context")
    assert Node.objects.get(name="gpu-g").group == "long-context"
    node_up("gpu-g")  # a heartbeat without a group keeps it
    assert Node.objects.get(pk=node.pk).group == "long-context"
    assert node_up("gpu-h").group == "default"
    with pytest.raises(ValueError, match="^group:"):
        node_up("gpu-i", group="no spaces")


@pytest.mark.django_db(transaction=True)
def test_concurrent_edits_get_consecutive_versions(sent_tasks):
    """Writers from several connections at once: every edit gets its own version, numbered
    without gaps or duplicates (the advisory lock serialises them)."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    start = PolicyVersion.objects.count()

    def edit(worker: int) -> None:
        try:
            for i in range(5):
                priorityclass_create(name=f"w{worker}-{i}", device_share=0.0, author=f"writer-{worker}")
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(edit, range(4)))
    numbers = list(PolicyVersion.objects.order_by("number").values_list("number", flat=True))
    assert len(numbers) == start + 20
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert PolicyVersion.objects.order_by("-number").first().snapshot == policy_state()
