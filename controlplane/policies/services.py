"""Policies writes: classes, tier policies, modes and their schedules; mode switches and rollbacks
(namespace quotas are written by `quotas`, through the same versioning).

Every change to classes, tier policies, quotas or modes (and every switch and rollback) writes a new
PolicyVersion holding the whole state, in the same transaction, after checking that the state is
valid on its own and under every mode. Writes take one advisory lock, so versions are numbered
without gaps and two edits never check against a state the other is changing.
"""

from __future__ import annotations

import json
import zoneinfo
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery.schedules import crontab
from django.db import connection, transaction
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from controlplane.events import send_event_on_commit
from controlplane.policies import rules
from controlplane.policies.choices import MODE_SWITCH_TASK, ModeKind
from controlplane.policies.dispatch import policies_dispatch_on_commit
from controlplane.policies.errors import InUse, PolicyError
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    NamespaceQuota,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)
from controlplane.policies.selectors import (
    CLASS_FIELD_DEFAULTS,
    base_specs,
    policy_state,
    policyversion_current,
    snapshot_current,
    tier_row_spec,
)
from controlplane.policies.specs import DEFAULT_CLASS, PolicySnapshot
from controlplane.settings.celery import CONTROL_QUEUE

# Key of the transaction-level advisory lock every policy write takes ("STRAT" in ASCII).
POLICY_LOCK_KEY = 0x5354524154


def _begin() -> PolicySnapshot:
    """Serialise policy writes and return the policies in force before this one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [POLICY_LOCK_KEY])
    return snapshot_current()


def _state_check(*, editing_mode: str | None = None) -> None:
    """The stored state must be valid on its own and with each mode's overrides laid over it.
    Errors about the mode being edited name its override paths; a base edit that would break
    another mode names the field and says which mode."""
    classes, tiers = base_specs()
    for spec in tiers:
        rules.tier_check(spec)
    rules.classes_check(classes)
    for mode in Mode.objects.order_by("name"):
        overrides = rules.overrides_parse(mode.overrides)
        try:
            rules.overrides_apply(classes, tiers, overrides)
        except PolicyError as exc:
            if mode.name == editing_mode:
                raise
            field = exc.field.rsplit(".", 1)[-1]
            raise PolicyError(f"{field}: under mode {mode.name!r} this would be invalid: {exc}", field=field) from exc


def _version_write(
    *,
    before: PolicySnapshot,
    action: str,
    author: str,
    comment: str,
    reason: str = "policy-change",
    editing_mode: str | None = None,
) -> PolicyVersion:
    """Check the new state, store it as the next version, announce it and, when the policies in
    force changed, tell the planner and the nodes (after commit)."""
    _state_check(editing_mode=editing_mode)
    number = policyversion_current() + 1
    version = PolicyVersion.objects.create(
        number=number, snapshot=policy_state(), action=action, author=author, comment=comment[:255]
    )
    after = snapshot_current()
    send_event_on_commit(
        kind="policy.changed",
        payload={"version": number, "action": action, "author": author, "comment": version.comment, "mode": after.mode},
    )
    if (after.mode, after.classes, after.tiers, after.quotas) != (
        before.mode,
        before.classes,
        before.tiers,
        before.quotas,
    ):
        policies_dispatch_on_commit(version=number, reason=reason, snapshot=after)
    return version


def _changed(row: Any, changes: Mapping[str, Any]) -> list[str]:
    return [name for name, value in changes.items() if getattr(row, name) != value]


def _describe(kind: str, name: str, fields: Iterable[str]) -> str:
    fields = list(fields)
    return f"{kind} {name}: " + (", ".join(fields) if fields else "no change")


# -- priority classes ------------------------------------------------------------------------------


def _class_values(data: Mapping[str, Any]) -> dict[str, Any]:
    clean = rules.fields_check(data, rules.CLASS_RULES)
    if "namespaces" in clean:
        clean["namespaces"] = list(clean["namespaces"])
    return clean


@transaction.atomic
def priorityclass_create(
    *,
    name: str,
    device_share: float,
    weight: float = 1.0,
    namespaces: Sequence[str] = (),
    remote_write: str = "on-demotion",
    author: str = "",
    comment: str = "",
) -> PriorityClass:
    """A new class. Its device share must fit beside the others' (all together at most 100%)."""
    before = _begin()
    clean = _class_values(
        {
            "name": name,
            "weight": weight,
            "device_share": device_share,
            "namespaces": list(namespaces),
            "remote_write": remote_write,
        }
    )
    if PriorityClass.objects.filter(name=name).exists():
        raise PolicyError(f"name: a priority class named {name!r} exists", field="name")
    row = PriorityClass.objects.create(**clean)
    _version_write(
        before=before, action="priority-class.create", author=author, comment=comment or f"create priority class {name}"
    )
    return row


@transaction.atomic
def priorityclass_update(
    *, priority_class: PriorityClass, author: str = "", comment: str = "", **changes: Any
) -> PriorityClass:
    """Change a class's weight, device share, namespaces or remote write (its name is what blocks
    refer to)."""
    before = _begin()
    if "name" in changes and changes["name"] != priority_class.name:
        raise PolicyError("name: a priority class cannot be renamed; create a new one", field="name")
    changes.pop("name", None)
    clean = _class_values(changes)
    changed = _changed(priority_class, clean)
    for field, value in clean.items():
        setattr(priority_class, field, value)
    priority_class.save()
    _version_write(
        before=before,
        action="priority-class.update",
        author=author,
        comment=comment or _describe("update priority class", priority_class.name, changed),
    )
    return priority_class


@transaction.atomic
def priorityclass_delete(*, priority_class: PriorityClass, author: str = "", comment: str = "") -> None:
    """Delete a class; its namespaces fall back to `default`, which itself cannot be deleted."""
    before = _begin()
    if priority_class.name == DEFAULT_CLASS:
        raise InUse(
            f"name: {DEFAULT_CLASS!r} holds every namespace no other class names; it cannot be deleted", field="name"
        )
    name = priority_class.name
    priority_class.delete()
    _version_write(
        before=before, action="priority-class.delete", author=author, comment=comment or f"delete priority class {name}"
    )


# -- tier policies ---------------------------------------------------------------------------------


@transaction.atomic
def tierpolicy_create(
    *, tier: str, node_group: str = "", author: str = "", comment: str = "", **fields: Any
) -> TierPolicy:
    """A policy for one tier, fleet-wide (`node_group` empty) or for one group of nodes."""
    before = _begin()
    clean = rules.fields_check({"tier": tier, "node_group": node_group, **fields}, rules.TIER_RULES)
    if TierPolicy.objects.filter(tier=tier, node_group=node_group).exists():
        where = f"node group {node_group!r}" if node_group else "the whole fleet"
        raise PolicyError(f"node_group: the {tier} tier already has a policy for {where}", field="node_group")
    row = TierPolicy(**clean)
    rules.tier_check(rules.tier_spec(clean))
    row.save()
    _version_write(
        before=before, action="tier-policy.create", author=author, comment=comment or f"create tier policy {row}"
    )
    return row


@transaction.atomic
def tierpolicy_update(*, policy: TierPolicy, author: str = "", comment: str = "", **changes: Any) -> TierPolicy:
    """Change a tier policy's limits, algorithm, TTL or destination (not which tier and group it
    is for: that is what other policies and modes refer to)."""
    before = _begin()
    for key in rules.TIER_KEY:
        if key in changes and changes[key] != getattr(policy, key):
            raise PolicyError(
                f"{key}: a tier policy's tier and node group cannot change; create a new policy", field=key
            )
        changes.pop(key, None)
    clean = rules.fields_check(changes, rules.TIER_RULES)
    changed = _changed(policy, clean)
    for field, value in clean.items():
        setattr(policy, field, value)
    rules.tier_check(tier_row_spec(policy))
    policy.save()
    _version_write(
        before=before,
        action="tier-policy.update",
        author=author,
        comment=comment or _describe("update tier policy", str(policy), changed),
    )
    return policy


@transaction.atomic
def tierpolicy_delete(*, policy: TierPolicy, author: str = "", comment: str = "") -> None:
    """Delete a tier policy: its nodes fall back to the fleet-wide policy (or the built-in default)."""
    before = _begin()
    label = str(policy)
    policy.delete()
    _version_write(
        before=before, action="tier-policy.delete", author=author, comment=comment or f"delete tier policy {label}"
    )


# -- modes -----------------------------------------------------------------------------------------


def _overrides_clean(overrides: Any) -> dict[str, Any]:
    return rules.overrides_parse(overrides, prefix="overrides").as_json()


@transaction.atomic
def mode_create(
    *,
    name: str,
    kind: str = ModeKind.CUSTOM,
    description: str = "",
    overrides: Mapping[str, Any] | None = None,
    author: str = "",
    comment: str = "",
) -> Mode:
    """A new (inactive) mode. Its overrides must give valid policies over the current ones."""
    before = _begin()
    rules.fields_check({"name": name}, {"name": rules.CLASS_RULES["name"]})
    if kind not in ModeKind.values:
        raise PolicyError(f"kind: unknown kind {kind!r}; expected one of {', '.join(ModeKind.values)}", field="kind")
    if Mode.objects.filter(name=name).exists():
        raise PolicyError(f"name: a mode named {name!r} exists", field="name")
    mode = Mode.objects.create(
        name=name, kind=kind, description=description, overrides=_overrides_clean(overrides or {})
    )
    _version_write(
        before=before, action="mode.create", author=author, comment=comment or f"create mode {name}", editing_mode=name
    )
    return mode


@transaction.atomic
def mode_update(
    *,
    mode: Mode,
    kind: str | None = None,
    description: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    author: str = "",
    comment: str = "",
) -> Mode:
    """Change a mode's kind, description or overrides (all of them: the new overrides replace the
    old). Changing the active mode's overrides takes effect at once."""
    before = _begin()
    mode = Mode.objects.get(pk=mode.pk)
    changed = []
    if kind is not None:
        if kind not in ModeKind.values:
            raise PolicyError(
                f"kind: unknown kind {kind!r}; expected one of {', '.join(ModeKind.values)}", field="kind"
            )
        changed += ["kind"] if kind != mode.kind else []
        mode.kind = kind
    if description is not None:
        changed += ["description"] if description != mode.description else []
        mode.description = description
    if overrides is not None:
        clean = _overrides_clean(overrides)
        changed += ["overrides"] if clean != mode.overrides else []
        mode.overrides = clean
    mode.save()
    _version_write(
        before=before,
        action="mode.update",
        author=author,
        comment=comment or _describe("update mode", mode.name, changed),
        editing_mode=mode.name,
    )
    return mode


@transaction.atomic
def mode_delete(*, mode: Mode, author: str = "", comment: str = "") -> None:
    """Delete an inactive mode with its schedules."""
    before = _begin()
    mode = Mode.objects.get(pk=mode.pk)
    if mode.active:
        raise InUse(f"name: mode {mode.name!r} is active; deactivate it or switch to another first", field="name")
    name = mode.name
    _mode_forget(mode)
    _version_write(before=before, action="mode.delete", author=author, comment=comment or f"delete mode {name}")


def _mode_forget(mode: Mode) -> None:
    for schedule in mode.schedules.select_related("periodic_task"):
        _beat_forget(schedule)
    mode.delete()


@transaction.atomic
def mode_activate(*, name: str, author: str = "", comment: str = "") -> PolicyVersion | None:
    """Make `name` the active mode (the one before stops). Returns the new version, or None when
    the mode was already active (switching twice changes nothing)."""
    before = _begin()
    mode = Mode.objects.filter(name=name).first()
    if mode is None:
        raise PolicyError(f"name: no mode named {name!r}", field="name")
    if mode.active:
        return None
    Mode.objects.filter(active=True).update(active=False)
    Mode.objects.filter(pk=mode.pk).update(active=True)
    return _switched(before=before, mode=name, author=author, comment=comment or f"switch to mode {name}")


@transaction.atomic
def mode_deactivate(*, name: str, author: str = "", comment: str = "") -> PolicyVersion:
    """Stop the active mode `name`: the base policies apply alone again."""
    before = _begin()
    mode = Mode.objects.filter(name=name).first()
    if mode is None:
        raise PolicyError(f"name: no mode named {name!r}", field="name")
    if not mode.active:
        raise PolicyError(f"name: mode {name!r} is not active", field="name")
    Mode.objects.filter(pk=mode.pk).update(active=False)
    return _switched(before=before, mode="", author=author, comment=comment or f"leave mode {name}")


def _switched(*, before: PolicySnapshot, mode: str, author: str, comment: str) -> PolicyVersion:
    version = _version_write(before=before, action="mode.switch", author=author, comment=comment, reason="mode-switch")
    send_event_on_commit(
        kind="mode.switched",
        payload={"mode": mode, "previous": before.mode, "version": version.number, "author": author},
    )
    return version


# -- rollback --------------------------------------------------------------------------------------


@transaction.atomic
def policy_rollback(*, version: int, author: str = "", comment: str = "") -> PolicyVersion:
    """Restore classes, tier policies, namespace quotas, modes and the active mode as version `version` had them,
    and record that as a new version. Schedules of modes that version did not have are deleted
    with their modes; the others are kept."""
    before = _begin()
    target = PolicyVersion.objects.filter(number=version).first()
    if target is None:
        raise PolicyError(f"version: no policy version {version}", field="version")
    try:
        _state_restore(target.snapshot)
        written = _version_write(
            before=before, action="policy.rollback", author=author, comment=comment or f"rollback to {version}"
        )
    except PolicyError as exc:
        raise PolicyError(
            f"version: version {version} cannot be restored under today's rules: {exc}", field="version"
        ) from exc
    if before.mode != written.snapshot["active_mode"]:
        send_event_on_commit(
            kind="mode.switched",
            payload={
                "mode": written.snapshot["active_mode"],
                "previous": before.mode,
                "version": written.number,
                "author": author,
            },
        )
    return written


def _state_restore(state: Mapping[str, Any]) -> None:
    # A version stored before a class field existed restores the field's default.
    classes = [_class_values({**CLASS_FIELD_DEFAULTS, **c}) for c in state.get("classes", [])]
    PriorityClass.objects.exclude(name__in=[c["name"] for c in classes]).delete()
    for values in classes:
        PriorityClass.objects.update_or_create(name=values["name"], defaults=values)

    tiers = [rules.fields_check(t, rules.TIER_RULES) for t in state.get("tiers", [])]
    keep = {(t["tier"], t.get("node_group", "")) for t in tiers}
    for row in TierPolicy.objects.all():
        if (row.tier, row.node_group) not in keep:
            row.delete()
    for values in tiers:
        rules.tier_check(rules.tier_spec(values))
        TierPolicy.objects.update_or_create(
            tier=values["tier"], node_group=values.get("node_group", ""), defaults=values
        )

    quotas = [rules.fields_check(q, rules.QUOTA_RULES) for q in state.get("quotas", [])]
    NamespaceQuota.objects.all().delete()
    NamespaceQuota.objects.bulk_create(NamespaceQuota(**values) for values in quotas)

    modes = state.get("modes", [])
    Mode.objects.filter(active=True).update(active=False)
    for mode in Mode.objects.exclude(name__in=[m["name"] for m in modes]):
        _mode_forget(mode)
    for entry in modes:
        Mode.objects.update_or_create(
            name=entry["name"],
            defaults={
                "kind": entry.get("kind", ModeKind.CUSTOM),
                "description": entry.get("description", ""),
                "overrides": _overrides_clean(entry.get("overrides", {})),
            },
        )
    if state.get("active_mode"):
        Mode.objects.filter(name=state["active_mode"]).update(active=True)


# -- mode schedules --------------------------------------------------------------------------------

CRON_FIELDS = (
    ("minute", "minute"),
    ("hour", "hour"),
    ("day of month", "day_of_month"),
    ("month", "month_of_year"),
    ("day of week", "day_of_week"),
)


def cron_parse(cron: str) -> dict[str, str]:
    """The five fields of a cron expression ("m h dom mon dow") as celery's crontab arguments;
    a bad expression raises PolicyError (field `cron`) saying which part is wrong."""
    if not isinstance(cron, str):
        raise PolicyError(f"cron: expected text, got {cron!r}", field="cron")
    parts = cron.split()
    if len(parts) != 5:
        raise PolicyError(
            f'cron: expected 5 fields "minute hour day-of-month month day-of-week", got {len(parts)} in {cron!r}',
            field="cron",
        )
    fields = {}
    for (label, argument), value in zip(CRON_FIELDS, parts, strict=True):
        try:
            crontab(**{argument: value})
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise PolicyError(f"cron: {label} {value!r} is not valid: {exc}", field="cron") from exc
        fields[argument] = value
    try:
        crontab(**fields)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise PolicyError(f"cron: {cron!r} is not valid: {exc}", field="cron") from exc
    return fields


def _beat_name(schedule: ModeSchedule) -> str:
    return f"policies: mode schedule {schedule.pk} (switch to {schedule.mode.name})"


def _beat_sync(schedule: ModeSchedule) -> None:
    """Create or update the beat entry of a schedule: a crontab running policies.mode_switch."""
    fields = cron_parse(schedule.cron)
    cron_row, _ = CrontabSchedule.objects.get_or_create(timezone=zoneinfo.ZoneInfo("UTC"), **fields)
    task = schedule.periodic_task or PeriodicTask()
    task.name = _beat_name(schedule)
    task.task = MODE_SWITCH_TASK
    task.kwargs = json.dumps({"name": schedule.mode.name})
    task.queue = CONTROL_QUEUE
    task.crontab = cron_row
    task.interval = None
    task.enabled = schedule.enabled
    task.description = f"Switch the policies to mode {schedule.mode.name} at {schedule.cron} (UTC)."
    task.save()
    if schedule.periodic_task_id != task.pk:
        schedule.periodic_task = task
        schedule.save(update_fields=["periodic_task"])


def _beat_forget(schedule: ModeSchedule) -> None:
    if schedule.periodic_task is not None:
        schedule.periodic_task.delete()


def _mode_named(name: str) -> Mode:
    mode = Mode.objects.filter(name=name).first()
    if mode is None:
        raise PolicyError(f"mode: no mode named {name!r}", field="mode")
    return mode


@transaction.atomic
def modeschedule_create(*, mode: str, cron: str, enabled: bool = True, author: str = "") -> ModeSchedule:
    """Switch to `mode` at the times of `cron` (UTC) from now on, through a beat entry."""
    cron_parse(cron)
    schedule = ModeSchedule.objects.create(
        mode=_mode_named(mode), cron=" ".join(cron.split()), enabled=enabled, author=author
    )
    _beat_sync(schedule)
    return schedule


@transaction.atomic
def modeschedule_update(
    *,
    schedule: ModeSchedule,
    mode: str | None = None,
    cron: str | None = None,
    enabled: bool | None = None,
    author: str = "",
) -> ModeSchedule:
    """Change a schedule's mode, times or whether it runs; its beat entry follows."""
    schedule = (
        ModeSchedule.objects.select_for_update(of=("self",)).select_related("mode", "periodic_task").get(pk=schedule.pk)
    )
    if cron is not None:
        cron_parse(cron)
        schedule.cron = " ".join(cron.split())
    if mode is not None:
        schedule.mode = _mode_named(mode)
    if enabled is not None:
        schedule.enabled = enabled
    schedule.author = author
    schedule.save()
    _beat_sync(schedule)
    return schedule


@transaction.atomic
def modeschedule_delete(*, schedule: ModeSchedule) -> None:
    """Delete a schedule and its beat entry."""
    schedule = ModeSchedule.objects.select_related("periodic_task").get(pk=schedule.pk)
    _beat_forget(schedule)
    schedule.delete()
