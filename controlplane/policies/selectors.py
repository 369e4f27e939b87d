"""Policies reads: the policies in force (the planner's snapshot), the stored state, versions and their diffs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import connection
from django.db.models import Max, QuerySet

from controlplane.directory.choices import TIER_ORDER, PlacementState
from controlplane.directory.models import Namespace
from controlplane.directory.queries import BLOCK_TABLE, NODE_TABLE, PLACEMENT_TABLE, ints
from controlplane.policies import rules
from controlplane.policies.errors import PolicyError
from controlplane.policies.models import (
    Mode,
    ModeSchedule,
    NamespaceQuota,
    PolicyVersion,
    PriorityClass,
    TierPolicy,
)
from controlplane.policies.specs import QUOTA_TIERS, PolicySnapshot, PriorityClassSpec, QuotaSpec, TierPolicySpec


def priorityclasses_list() -> QuerySet[PriorityClass]:
    return PriorityClass.objects.all()


def tierpolicies_list() -> QuerySet[TierPolicy]:
    return TierPolicy.objects.all()


def namespacequotas_list() -> QuerySet[NamespaceQuota]:
    return NamespaceQuota.objects.all()


def modes_list() -> QuerySet[Mode]:
    return Mode.objects.all()


def modeschedules_list() -> QuerySet[ModeSchedule]:
    return ModeSchedule.objects.select_related("mode", "periodic_task")


def policyversions_list() -> QuerySet[PolicyVersion]:
    return PolicyVersion.objects.all()


def policyversion_current() -> int:
    """The number of the latest version (0 before the first)."""
    return PolicyVersion.objects.aggregate(n=Max("number"))["n"] or 0


def class_row_spec(row: PriorityClass) -> PriorityClassSpec:
    return PriorityClassSpec(
        name=row.name,
        weight=row.weight,
        device_share=row.device_share,
        namespaces=tuple(sorted(row.namespaces)),
        remote_write=row.remote_write,
    )


def tier_row_spec(row: TierPolicy) -> TierPolicySpec:
    return TierPolicySpec(
        tier=row.tier,
        node_group=row.node_group,
        capacity_bytes=row.capacity_bytes,
        high_watermark=row.high_watermark,
        low_watermark=row.low_watermark,
        algorithm=row.algorithm,
        ttl_seconds=row.ttl_seconds,
        min_accesses=row.min_accesses,
        capacity_fraction=row.capacity_fraction,
        demote_tier=row.demote_tier,
    )


def base_specs() -> tuple[tuple[PriorityClassSpec, ...], tuple[TierPolicySpec, ...]]:
    """The stored classes and tier policies, without any mode."""
    classes = tuple(class_row_spec(row) for row in PriorityClass.objects.order_by("name"))
    tiers = rules.tiers_sorted(tier_row_spec(row) for row in TierPolicy.objects.all())
    return classes, tiers


def quota_specs() -> tuple[QuotaSpec, ...]:
    """The stored namespace quotas (modes do not override them), by namespace and tier order."""
    rows = sorted(NamespaceQuota.objects.all(), key=lambda r: (r.namespace, QUOTA_TIERS.index(r.tier)))
    return tuple(QuotaSpec(namespace=r.namespace, tier=r.tier, bytes=r.bytes) for r in rows)


def snapshot_current(*, overrides: Mapping[str, Any] | None = None) -> PolicySnapshot:
    """The policies in force: the stored ones with the active mode's overrides laid over them, and
    `overrides` (a dry-run's proposal, the same shape as a mode's) over that. A bad proposal raises
    PolicyError naming the path of the field (overrides.tiers[0].low_watermark)."""
    classes, tiers = base_specs()
    mode = Mode.objects.filter(active=True).first()
    if mode is not None:
        classes, tiers = rules.overrides_apply(
            classes, tiers, rules.overrides_parse(mode.overrides), prefix=f"modes.{mode.name}.overrides"
        )
    if overrides is not None:
        classes, tiers = rules.overrides_apply(classes, tiers, rules.overrides_parse(overrides))
    return PolicySnapshot(
        version=policyversion_current(),
        mode=mode.name if mode else "",
        classes=classes,
        tiers=tiers,
        quotas=quota_specs(),
    )


# -- the stored state as JSON (what a version holds) -----------------------------------------------

CLASS_FIELDS = ("name", "weight", "device_share", "namespaces", "remote_write")
TIER_FIELDS = (
    "tier",
    "node_group",
    "capacity_bytes",
    "capacity_fraction",
    "high_watermark",
    "low_watermark",
    "algorithm",
    "ttl_seconds",
    "min_accesses",
    "demote_tier",
)
MODE_FIELDS = ("name", "kind", "description", "overrides")
QUOTA_FIELDS = ("namespace", "tier", "bytes")


def policy_state() -> dict[str, Any]:
    """Every class, tier policy, namespace quota and mode and the active mode, as the JSON a version stores."""
    modes = list(Mode.objects.order_by("name"))
    return {
        "classes": [
            {**{f: getattr(row, f) for f in CLASS_FIELDS}, "namespaces": sorted(row.namespaces)}
            for row in PriorityClass.objects.order_by("name")
        ],
        "tiers": [
            {f: getattr(row, f) for f in TIER_FIELDS}
            for row in sorted(TierPolicy.objects.all(), key=lambda r: (TIER_ORDER.index(r.tier), r.node_group))
        ],
        "quotas": [{"namespace": q.namespace, "tier": q.tier, "bytes": q.bytes} for q in quota_specs()],
        "modes": [{f: getattr(row, f) for f in MODE_FIELDS} for row in modes],
        "active_mode": next((m.name for m in modes if m.active), ""),
    }


CLASS_FIELD_DEFAULTS = {"remote_write": "on-demotion"}
"""Class fields a version stored before they existed had at their default."""


def _keyed(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "classes": {c["name"]: {**CLASS_FIELD_DEFAULTS, **c} for c in state.get("classes", [])},
        "tiers": {f"{t['tier']}@{t.get('node_group') or 'fleet'}": t for t in state.get("tiers", [])},
        "quotas": {f"{q['namespace']}@{q['tier']}": q for q in state.get("quotas", [])},
        "modes": {m["name"]: m for m in state.get("modes", [])},
    }


def policy_state_diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Field-level differences between two stored states: one entry per added or removed object
    and per changed field, with a path such as classes.batch.device_share, tiers.host@fleet.ttl_seconds
    or quotas.tenant-a@host.bytes."""
    changes: list[dict[str, Any]] = []
    old, new = _keyed(before), _keyed(after)
    for section in ("classes", "tiers", "quotas", "modes"):
        for key in sorted(old[section].keys() | new[section].keys()):
            a, b = old[section].get(key), new[section].get(key)
            path = f"{section}.{key}"
            if a is None:
                changes.append({"path": path, "change": "added", "before": None, "after": b})
            elif b is None:
                changes.append({"path": path, "change": "removed", "before": a, "after": None})
            else:
                for field in sorted(a.keys() | b.keys()):
                    if a.get(field) != b.get(field):
                        changes.append(
                            {
                                "path": f"{path}.{field}",
                                "change": "changed",
                                "before": a.get(field),
                                "after": b.get(field),
                            }
                        )
    if before.get("active_mode", "") != after.get("active_mode", ""):
        changes.append(
            {
                "path": "active_mode",
                "change": "changed",
                "before": before.get("active_mode", ""),
                "after": after.get("active_mode", ""),
            }
        )
    return changes


# -- quota use (what the directory's placements hold per namespace) -------------------------------

# A namespace's blocks through its (namespace, model, id) index, their copies through the
# placement's (block, tier, node) index: the cost follows what the namespace holds. Copies being
# written count too: they take the room already.
_QUOTA_USE_SQL = f"""
SELECT b.namespace_id, p.tier, coalesce(n.name, ''), sum(p.size_bytes)
FROM {BLOCK_TABLE} b
JOIN {PLACEMENT_TABLE} p ON p.block_id = b.id
LEFT JOIN {NODE_TABLE} n ON n.id = p.node_id
WHERE b.namespace_id = ANY(%s::bigint[]) AND p.tier = ANY(%s::text[])
  AND p.state IN ('{PlacementState.READY.value}', '{PlacementState.PENDING.value}')
GROUP BY 1, 2, 3
"""


def quota_usage(*, namespace: str | None = None) -> list[dict[str, Any]]:
    """Per namespace and quota tier: the quota (None: none) and the bytes its copies hold, per node
    for host and disk (`used_bytes` is the fullest node's, which is what the quota caps) and
    fleet-wide for remote. Every namespace with a quota, or only `namespace` (all three tiers,
    with or without a quota; an unknown one raises PolicyError)."""
    quotas = {(q.namespace, q.tier): q.bytes for q in quota_specs()}
    if namespace is not None:
        names = [namespace]
        keys = [(namespace, tier) for tier in QUOTA_TIERS]
    else:
        names = sorted({name for name, _ in quotas})
        keys = sorted(quotas, key=lambda k: (k[0], QUOTA_TIERS.index(k[1])))
    ids = dict(Namespace.objects.filter(name__in=names).values_list("id", "name"))
    if namespace is not None and not ids:
        raise PolicyError(f"namespace: no namespace named {namespace!r}", field="namespace")
    per_node: dict[tuple[str, str], dict[str, int]] = {}
    if ids:
        with connection.cursor() as cursor:
            cursor.execute(_QUOTA_USE_SQL, [ints(sorted(ids)), "{" + ",".join(QUOTA_TIERS) + "}"])
            for ns_id, tier, node, total in cursor.fetchall():
                per_node.setdefault((ids[ns_id], tier), {})[node] = int(total)
    rows = []
    for name, tier in keys:
        nodes = per_node.get((name, tier), {})
        quota = quotas.get((name, tier))
        used = max(nodes.values(), default=0)
        rows.append(
            {
                "namespace": name,
                "tier": tier,
                "quota_bytes": quota,
                "used_bytes": used,
                "over": quota is not None and used > quota,
                "nodes": [
                    {"node": node, "used_bytes": nbytes, "over": quota is not None and nbytes > quota}
                    for node, nbytes in sorted(nodes.items())
                ],
            }
        )
    return rows
