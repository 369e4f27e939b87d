"""The rules every policy obeys, and how a mode's overrides are read and laid over the base policies.

One set of field rules serves the stored policies, a mode's overrides and a dry-run's proposal, so
a value refused in one place is refused in all of them, with the same field named.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from controlplane.directory.choices import TIER_ORDER
from controlplane.policies.errors import PolicyError
from controlplane.policies.specs import (
    ALGORITHMS,
    QUOTA_TIERS,
    REMOTE_WRITES,
    PriorityClassSpec,
    TierPolicySpec,
)

BIGINT_MAX = 2**63 - 1
INTEGER_MAX = 2**31 - 1
SHARE_TOLERANCE = 1e-9
"""Shares are floats: 0.7 + 0.2 + 0.1 may add up to a hair over 1."""

_SLUG_RE = re.compile(r"^[-a-zA-Z0-9_]{1,63}$")

Checker = Callable[[Any, str], Any]


def _fail(path: str, message: str) -> PolicyError:
    return PolicyError(f"{path}: {message}", field=path)


def _float(*, low: float, high: float, low_open: bool, high_open: bool = False) -> Checker:
    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _fail(path, f"must be a number, got {value!r}")
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise _fail(path, f"must be in {interval}, got {value!r}")
        return float(value)

    return check


def _int(*, minimum: int, maximum: int, nullable: bool = False) -> Checker:
    def check(value: Any, path: str) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"must be a whole number{' or null' if nullable else ''}, got {value!r}")
        if value < minimum:
            raise _fail(path, "cannot be negative" if minimum == 0 else f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise _fail(path, f"must be at most {maximum}, got {value}")
        return value

    return check


def _choice(choices: Sequence[str], *, blank: bool = False) -> Checker:
    def check(value: Any, path: str) -> str:
        if blank and value == "":
            return ""
        if not isinstance(value, str) or value not in choices:
            raise _fail(
                path,
                f"unknown value {value!r}; expected one of {', '.join(choices)}" + (" (or empty)" if blank else ""),
            )
        return value

    return check


def _slug(*, blank: bool = False) -> Checker:
    def check(value: Any, path: str) -> str:
        if blank and value == "":
            return ""
        if not isinstance(value, str) or not _SLUG_RE.match(value):
            raise _fail(path, f"expected 1-63 letters, digits, '-' or '_', got {value!r}")
        return value

    return check


def _slug_list(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise _fail(path, f"must be a list of namespace names, got {value!r}")
    names = tuple(_slug()(name, f"{path}[{i}]") for i, name in enumerate(value))
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise _fail(path, f"names {', '.join(duplicates)} more than once")
    return tuple(sorted(names))


_FRACTION = _float(low=0.0, high=1.0, low_open=True)

TIER_RULES: dict[str, Checker] = {
    "tier": _choice(TIER_ORDER),
    "node_group": _slug(blank=True),
    "capacity_bytes": _int(minimum=0, maximum=BIGINT_MAX, nullable=True),
    "capacity_fraction": _FRACTION,
    "high_watermark": _FRACTION,
    "low_watermark": _FRACTION,
    "algorithm": _choice(ALGORITHMS),
    "ttl_seconds": _int(minimum=1, maximum=INTEGER_MAX, nullable=True),
    "min_accesses": _int(minimum=0, maximum=INTEGER_MAX),
    "demote_tier": _choice(TIER_ORDER, blank=True),
}
"""Every field of a tier policy (snapshot.TierPolicySpec) and its rule."""

CLASS_RULES: dict[str, Checker] = {
    "name": _slug(),
    "weight": _float(low=0.0, high=1e6, low_open=True),
    "device_share": _float(low=0.0, high=1.0, low_open=False),
    "namespaces": _slug_list,
    "remote_write": _choice(REMOTE_WRITES),
}
"""Every field of a priority class (snapshot.PriorityClassSpec) and its rule."""

QUOTA_RULES: dict[str, Checker] = {
    "namespace": _slug(),
    "tier": _choice(QUOTA_TIERS),
    "bytes": _int(minimum=1, maximum=BIGINT_MAX),
}
"""Every field of a namespace quota (snapshot.QuotaSpec) and its rule."""


TIER_KEY = ("tier", "node_group")
CLASS_KEY = ("name",)


def fields_check(data: Mapping[str, Any], rules: Mapping[str, Checker], *, prefix: str = "") -> dict[str, Any]:
    """The values of `data` as the rules normalise them; an unknown field or a bad value raises
    PolicyError naming `prefix` + the field."""
    clean: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{prefix}{name}"
        if name not in rules:
            raise _fail(path, f"unknown field; expected {', '.join(rules)}")
        clean[name] = rules[name](value, path)
    return clean


def tier_check(spec: TierPolicySpec, path: Callable[[str], str] = str) -> None:
    """Rules between a tier policy's fields (`path` names a field for the error)."""
    if spec.low_watermark >= spec.high_watermark:
        raise _fail(
            path("low_watermark"),
            f"the low watermark ({spec.low_watermark:g}) must be below the high "
            f"watermark ({spec.high_watermark:g}) of the {spec.tier} tier",
        )
    if spec.demote_tier and TIER_ORDER.index(spec.demote_tier) <= TIER_ORDER.index(spec.tier):
        raise _fail(
            path("demote_tier"),
            f"blocks leaving the {spec.tier} tier can only go to a slower tier "
            f"({', '.join(TIER_ORDER[TIER_ORDER.index(spec.tier) + 1 :]) or 'none'})",
        )


def classes_check(classes: Sequence[PriorityClassSpec], path: Callable[[str, str], str] = lambda name, f: f) -> None:
    """Rules between classes: their device shares fit the device tier together (so each class can
    always reach its share), and a namespace belongs to one class at most.
    `path(class_name, field)` names the field for the error."""
    total = sum(c.device_share for c in classes)
    if total > 1 + SHARE_TOLERANCE:
        parts = ", ".join(f"{c.name} {c.device_share:.0%}" for c in classes if c.device_share)
        culprit = max(classes, key=lambda c: c.device_share).name
        raise _fail(
            path(culprit, "device_share"), f"device shares of all classes add up to {total:.0%} ({parts}); at most 100%"
        )
    owner: dict[str, str] = {}
    for spec in classes:
        for namespace in spec.namespaces:
            if namespace in owner:
                raise _fail(
                    path(spec.name, "namespaces"),
                    f"namespace {namespace!r} already belongs to class {owner[namespace]!r}",
                )
            owner[namespace] = spec.name


# -- overrides -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Overrides:
    """A mode's (or a dry-run's) changes to the base policies: partial tier policies keyed by
    (tier, node_group) and partial classes keyed by name. A key with no base policy adds one:
    a tier policy starts from the policy in force for that tier and group, a class from the
    class defaults."""

    tiers: tuple[dict[str, Any], ...] = ()
    classes: tuple[dict[str, Any], ...] = ()

    def as_json(self) -> dict[str, list[dict[str, Any]]]:
        return {"tiers": [dict(t) for t in self.tiers], "classes": [dict(c) for c in self.classes]}

    def __bool__(self) -> bool:
        return bool(self.tiers or self.classes)


def overrides_parse(raw: Any, *, prefix: str = "overrides") -> Overrides:
    """Read overrides JSON ({"tiers": [...], "classes": [...]}, both optional); every field obeys
    the rules of the policy it overrides. Errors name the path, e.g. overrides.tiers[0].low_watermark."""
    if raw is None:
        return Overrides()
    if not isinstance(raw, Mapping):
        raise _fail(prefix, 'must be an object with "tiers" and/or "classes" lists')
    unknown = sorted(set(raw) - {"tiers", "classes"})
    if unknown:
        raise _fail(f"{prefix}.{unknown[0]}", 'unknown key; overrides have "tiers" and "classes"')
    tiers = _entries(raw.get("tiers", []), TIER_RULES, TIER_KEY, f"{prefix}.tiers", defaults={"node_group": ""})
    classes = _entries(raw.get("classes", []), CLASS_RULES, CLASS_KEY, f"{prefix}.classes", defaults={})
    return Overrides(tiers=tiers, classes=classes)


def _entries(
    raw: Any, rules: Mapping[str, Checker], key: Sequence[str], prefix: str, defaults: Mapping[str, Any]
) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list | tuple):
        raise _fail(prefix, f"must be a list, got {raw!r}")
    seen: dict[tuple[Any, ...], int] = {}
    entries = []
    for i, entry in enumerate(raw):
        path = f"{prefix}[{i}]"
        if not isinstance(entry, Mapping):
            raise _fail(path, f"must be an object, got {entry!r}")
        if key[0] not in entry:
            raise _fail(f"{path}.{key[0]}", "required: it says which policy the entry overrides")
        clean = {**defaults, **fields_check(entry, rules, prefix=f"{path}.")}
        ident = tuple(clean[k] for k in key)
        if ident in seen:
            raise _fail(f"{path}.{key[0]}", f"overridden twice (also entry {seen[ident]})")
        seen[ident] = i
        entries.append(clean)
    return tuple(entries)


def _tier_base(tiers: Sequence[TierPolicySpec], tier: str, node_group: str) -> TierPolicySpec:
    fleet = None
    for spec in tiers:
        if spec.tier == tier and spec.node_group == node_group:
            return spec
        if spec.tier == tier and not spec.node_group:
            fleet = spec
    return dataclasses.replace(fleet or TierPolicySpec(tier=tier), node_group=node_group)


def _class_fields(entry: Mapping[str, Any]) -> dict[str, Any]:
    fields = {k: v for k, v in entry.items() if k != "name"}
    if "namespaces" in fields:
        fields["namespaces"] = tuple(fields["namespaces"])
    return fields


def _under(prefix: str) -> Callable[[str], str]:
    def path(field: str) -> str:
        return prefix + field

    return path


def overrides_apply(
    classes: Sequence[PriorityClassSpec],
    tiers: Sequence[TierPolicySpec],
    overrides: Overrides,
    *,
    prefix: str = "overrides",
) -> tuple[tuple[PriorityClassSpec, ...], tuple[TierPolicySpec, ...]]:
    """The classes and tier policies with `overrides` laid over them, checked together: an error
    names the override entry that caused it (prefix.tiers[i].field, prefix.classes[i].field)."""
    merged_tiers = list(tiers)
    for i, entry in enumerate(overrides.tiers):
        base = _tier_base(merged_tiers, entry["tier"], entry["node_group"])
        spec = dataclasses.replace(base, **{k: v for k, v in entry.items() if k not in TIER_KEY})
        merged_tiers = [t for t in merged_tiers if (t.tier, t.node_group) != (spec.tier, spec.node_group)]
        merged_tiers.append(spec)
        tier_check(spec, _under(f"{prefix}.tiers[{i}]."))
    by_name = {c.name: c for c in classes}
    for entry in overrides.classes:
        name = entry["name"]
        base_class = by_name.get(name, PriorityClassSpec(name=name))
        by_name[name] = dataclasses.replace(base_class, **_class_fields(entry))
    merged_classes = tuple(sorted(by_name.values(), key=lambda c: c.name))
    index = {entry["name"]: i for i, entry in enumerate(overrides.classes)}

    def class_path(name: str, field: str) -> str:
        if field == "device_share":
            # Blame the first override that sets a share: the base shares fitted on their own.
            setters = [i for i, entry in enumerate(overrides.classes) if "device_share" in entry]
            if setters:
                return f"{prefix}.classes[{setters[0]}].device_share"
        if name in index:
            return f"{prefix}.classes[{index[name]}].{field}"
        return field

    classes_check(merged_classes, class_path)
    return merged_classes, tiers_sorted(merged_tiers)


def tiers_sorted(tiers: Iterable[TierPolicySpec]) -> tuple[TierPolicySpec, ...]:
    """Fastest tier first, the fleet-wide policy before the groups' own."""
    return tuple(sorted(tiers, key=lambda t: (TIER_ORDER.index(t.tier), t.node_group)))


def tier_spec(data: Mapping[str, Any]) -> TierPolicySpec:
    """A tier policy spec from stored or snapshot JSON (fields it lacks take their defaults)."""
    names = {f.name for f in dataclasses.fields(TierPolicySpec)}
    return TierPolicySpec(**{k: v for k, v in data.items() if k in names})


def class_spec(data: Mapping[str, Any]) -> PriorityClassSpec:
    """A priority class spec from stored or snapshot JSON (fields it lacks take their defaults)."""
    names = {f.name for f in dataclasses.fields(PriorityClassSpec)}
    fields = {k: v for k, v in data.items() if k in names}
    if "namespaces" in fields:
        fields["namespaces"] = tuple(fields["namespaces"])
    return PriorityClassSpec(**fields)
