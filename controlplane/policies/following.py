"""Load-following: switch modes as the nodes' traffic calls for (loadfollow has the pure rules).

Each check reads the latest traffic of the nodes that reported recently, classifies the fleet's
shape, and switches through mode_activate / mode_deactivate with the measured shape as the
comment, so the PolicyVersion records why; a `mode.followed` dashboard event carries the same
reason. A switch by anyone else (an operator, a schedule) holds load-following off for a while.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.directory.choices import NodeState
from controlplane.directory.models import NodeTraffic
from controlplane.events import send_event_on_commit
from controlplane.policies import loadfollow
from controlplane.policies.errors import PolicyError
from controlplane.policies.models import LoadFollowing, Mode, PolicyVersion
from controlplane.policies.services import mode_activate, mode_deactivate
from worker.dataplane.traffic import PROMPT_BUCKETS, TrafficSummary

AUTHOR = "load-following"
SCHEDULE_AUTHOR = "schedule"

# Settings an operator may change, with their kinds; the rest of the row is state.
SETTINGS: dict[str, type] = {
    "enabled": bool,
    "window_seconds": float,
    "long_prompt_tokens": int,
    "chat_enter_rpm": float,
    "chat_leave_rpm": float,
    "long_enter_share": float,
    "long_leave_share": float,
    "quiet_enter_rpm": float,
    "quiet_leave_rpm": float,
    "pressure_enter": float,
    "queue_enter": float,
    "min_dwell_seconds": float,
    "manual_hold_seconds": float,
    "schedule_hold_seconds": float,
}


@dataclasses.dataclass(frozen=True)
class FollowResult:
    """What one check did: `action` is disabled, held, no-traffic, stay, wait, no-mode or switched."""

    action: str
    target: str = ""
    reason: str = ""
    version: int | None = None


def loadfollowing_get(*, lock: bool = False) -> LoadFollowing:
    """The settings row (created with its defaults when missing)."""
    if lock:
        LoadFollowing.objects.get_or_create(id=1)
        return LoadFollowing.objects.select_for_update().get(id=1)
    return LoadFollowing.objects.get_or_create(id=1)[0]


def thresholds_of(row: LoadFollowing) -> loadfollow.Thresholds:
    return loadfollow.Thresholds(
        **{f.name: getattr(row, f.name) for f in dataclasses.fields(loadfollow.Thresholds)},
    )


def _settings_check(row: LoadFollowing) -> None:
    """Raise PolicyError naming the first setting that is out of range."""
    if row.long_prompt_tokens not in PROMPT_BUCKETS:
        raise PolicyError(
            f"long_prompt_tokens: must be one of {', '.join(map(str, PROMPT_BUCKETS))}, got {row.long_prompt_tokens}",
            field="long_prompt_tokens",
        )
    for name in ("window_seconds",):
        if getattr(row, name) <= 0:
            raise PolicyError(f"{name}: must be above zero, got {getattr(row, name)}", field=name)
    for name in ("manual_hold_seconds", "schedule_hold_seconds"):
        if getattr(row, name) < 0:
            raise PolicyError(f"{name}: cannot be negative, got {getattr(row, name)}", field=name)
    try:
        thresholds_of(row).check()
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise PolicyError(str(exc), field=field) from exc


@transaction.atomic
def loadfollowing_update(*, author: str = "", **changes: Any) -> LoadFollowing:
    """Change load-following's settings (the names in SETTINGS); bad values raise PolicyError
    naming the field, and nothing is stored then."""
    row = loadfollowing_get(lock=True)
    for name, value in changes.items():
        kind = SETTINGS.get(name)
        if kind is None:
            raise PolicyError(f"{name}: not a load-following setting", field=name)
        ok = isinstance(value, bool) if kind is bool else isinstance(value, int | float) and not isinstance(value, bool)
        if kind is int and ok and value != int(value):
            ok = False
        if not ok:
            raise PolicyError(f"{name}: expected {kind.__name__}, got {value!r}", field=name)
        setattr(row, name, kind(value))
    _settings_check(row)
    row.author = author
    row.save()
    return row


@transaction.atomic
def loadfollowing_resume(*, author: str = "", now: datetime | None = None) -> LoadFollowing:
    """End a manual or scheduled hold now: the next check follows the traffic again."""
    row = loadfollowing_get(lock=True)
    row.resumed_at = now or timezone.now()
    row.author = author
    row.save(update_fields=["resumed_at", "author", "updated_at"])
    return row


def hold_of(row: LoadFollowing, now: datetime) -> str:
    """Why load-following must not switch now (a recent switch by someone else), or "". A rollback
    counts as a manual switch: it restores a mode (or none) on purpose."""
    switch = (
        PolicyVersion.objects.filter(action__in=("mode.switch", "policy.rollback"))
        .exclude(author=AUTHOR)
        .order_by("-number")
        .first()
    )
    if switch is None or (row.resumed_at is not None and switch.created_at <= row.resumed_at):
        return ""
    scheduled = switch.author == SCHEDULE_AUTHOR
    seconds = row.schedule_hold_seconds if scheduled else row.manual_hold_seconds
    until = switch.created_at + timedelta(seconds=seconds)
    if now >= until:
        return ""
    who = "a scheduled switch" if scheduled else f"a manual switch by {switch.author or 'the system'}"
    return f"load-following held by {who} (v{switch.number}) until {until.isoformat(timespec='seconds')}"


def fleet_shape(row: LoadFollowing, now: datetime) -> loadfollow.Shape | None:
    """The shape of the traffic of the up nodes that reported within the window."""
    rows = NodeTraffic.objects.filter(
        updated_at__gte=now - timedelta(seconds=row.window_seconds), node__state=NodeState.UP
    )
    samples = []
    for r in rows:
        summary = TrafficSummary(
            window_seconds=r.window_seconds,
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            prompt_buckets=tuple(r.prompt_buckets),
            queue_depth=r.queue_depth,
            l1_pressure=r.l1_pressure,
        )
        samples.append(
            loadfollow.NodeSample(
                requests=r.requests,
                window_seconds=r.window_seconds,
                long_prompts=summary.prompts_at_least(row.long_prompt_tokens),
                prompt_tokens=r.prompt_tokens,
                l1_pressure=r.l1_pressure,
                queue_depth=r.queue_depth,
            )
        )
    return loadfollow.fleet_shape(samples)


def _record(row: LoadFollowing, now: datetime, result: FollowResult) -> FollowResult:
    row.checked_at = now
    row.last_reason = result.reason[:255]
    row.save(update_fields=["checked_at", "last_reason", "mode", "switched_at", "updated_at"])
    return result


@transaction.atomic
def load_follow(*, now: datetime | None = None) -> FollowResult:
    """One check: classify the fleet's recent traffic and switch modes if it calls for another
    (unless disabled, held by another switch, or still within the minimum dwell)."""
    now = now or timezone.now()
    row = loadfollowing_get(lock=True)
    if not row.enabled:
        return FollowResult(action="disabled", reason="load-following is off")
    hold = hold_of(row, now)
    if hold:
        return _record(row, now, FollowResult(action="held", reason=hold))
    shape = fleet_shape(row, now)
    if shape is None:
        return _record(row, now, FollowResult(action="no-traffic", reason="load-following: no node reported traffic"))
    active = Mode.objects.filter(active=True).first()
    current = active.kind if active is not None and active.kind in loadfollow.KINDS else loadfollow.NONE
    dwelt = (now - row.switched_at).total_seconds() if row.switched_at is not None else None
    decision = loadfollow.decide(shape, thresholds_of(row), current=current, dwelt_seconds=dwelt)
    if not decision.switch:
        action = "stay" if decision.target == current else "wait"
        return _record(row, now, FollowResult(action=action, target=decision.target, reason=decision.reason))
    if decision.target:
        mode = Mode.objects.filter(kind=decision.target).order_by("name").first()
        if mode is None:
            reason = f"{decision.reason}, but no mode of kind {decision.target} exists"
            return _record(row, now, FollowResult(action="no-mode", target=decision.target, reason=reason))
        version = mode_activate(name=mode.name, author=AUTHOR, comment=decision.reason)
        name = mode.name
    else:
        assert active is not None  # current is a kind, so a mode of it is active
        version = mode_deactivate(name=active.name, author=AUTHOR, comment=decision.reason)
        name = ""
    row.mode = name
    row.switched_at = now
    number = version.number if version is not None else None
    if number is not None:
        send_event_on_commit(
            kind="mode.followed",
            payload={
                "mode": name,
                "previous": active.name if active is not None else "",
                "version": number,
                "reason": decision.reason,
            },
        )
    return _record(
        row, now, FollowResult(action="switched", target=decision.target, reason=decision.reason, version=number)
    )
