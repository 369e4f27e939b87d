"""Dashboard reads: the overview snapshot, alerts, and what the nodes' engine servers report.

The directory (PostgreSQL) is the truth for nodes, tiers and blocks. Request timelines and cache
counters live in each node's engine process; the control plane fetches them from the node's
address with a short timeout, so one slow or dead node never holds a page up. Before it sends a
node anything it checks the address the node reported against where the node's heartbeat came
from and the operator's STRATA_NODE_ADDRESSES (controlplane.runtime.node_addresses), and it sends
each node its own admin key (controlplane.directory.selectors.node_admin_keys), never another's;
redirects are not followed, so a node cannot forward the key elsewhere."""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlplane.directory.choices import TIER_ORDER, NodeState, PlacementState
from controlplane.directory.models import Block, Node, Placement
from controlplane.directory.selectors import node_admin_keys, nodes_list
from controlplane.directory.services import node_payload
from controlplane.events import sequence_current
from controlplane.policies.snapshot import PolicySnapshot, policies_snapshot
from controlplane.runtime.node_addresses import AddressRefused, node_target
from controlplane.telemetry.metrics import NODE_ADDRESS_REFUSED, NODE_FETCH_FAILURES

log = logging.getLogger("strata.dashboard")

NODE_FETCH_TIMEOUT_S = 1.5
"""How long the control plane waits for one node's engine server before reporting it unreachable."""
MAX_FETCH_BYTES = 4 * 1024 * 1024
"""Largest answer read from a node (50 request traces of a deep model fit easily)."""


@dataclasses.dataclass(frozen=True)
class Alert:
    """Something an operator should look at, in words."""

    kind: str
    severity: str
    message: str
    node: str = ""
    tier: str = ""


def _ordered_tiers(node: Node) -> list[Any]:
    return sorted(node.tiers.all(), key=lambda t: TIER_ORDER.index(t.tier))


def alerts_list(*, nodes: Iterable[Node], policy: PolicySnapshot) -> list[Alert]:
    """Stale or down nodes, unavailable tiers, tiers above their high watermark, corrupt copies."""
    alerts: list[Alert] = []
    for node in nodes:
        if node.state == NodeState.STALE:
            age = (timezone.now() - node.last_seen).total_seconds()
            alerts.append(
                Alert(
                    "stale-node",
                    "critical",
                    f"node {node.name} missed its heartbeats (last seen {age:.0f} s ago)",
                    node=node.name,
                )
            )
        elif node.state == NodeState.DOWN:
            alerts.append(Alert("node-down", "warning", f"node {node.name} shut down", node=node.name))
        for tier in _ordered_tiers(node):
            if not tier.available:
                alerts.append(
                    Alert(
                        "tier-unavailable",
                        "critical",
                        f"tier {tier.tier} of node {node.name} is unavailable",
                        node=node.name,
                        tier=tier.tier,
                    )
                )
                continue
            if tier.capacity_bytes:
                fill = tier.used_bytes / tier.capacity_bytes
                high = policy.tier(tier.tier).high_watermark
                if fill > high:
                    alerts.append(
                        Alert(
                            "watermark",
                            "warning",
                            f"tier {tier.tier} of node {node.name} is {fill:.0%} full, above its "
                            f"high watermark of {high:.0%}",
                            node=node.name,
                            tier=tier.tier,
                        )
                    )
    corrupt = (
        Placement.objects.filter(state=PlacementState.CORRUPT)
        .values("node__name", "tier")
        .annotate(copies=Count("id"))
        .order_by("node__name", "tier")
    )
    for row in corrupt:
        where = f"node {row['node__name']}" if row["node__name"] else "the shared remote store"
        alerts.append(
            Alert(
                "corrupt-blocks",
                "critical",
                f"{row['copies']} corrupt cop{'y' if row['copies'] == 1 else 'ies'} quarantined in "
                f"tier {row['tier']} of {where}",
                node=row["node__name"] or "",
                tier=row["tier"],
            )
        )
    return alerts


def overview_get() -> dict[str, Any]:
    """Everything the overview and nodes pages show, with the event sequence number it is current at.

    The sequence number is read before the database: every event numbered at or below it was
    committed before the read, so its effect is in this snapshot; later events may or may not be,
    and applying them again is harmless (each carries the full new state of what it names)."""
    seq = sequence_current()
    policy = policies_snapshot()
    nodes = list(nodes_list())
    totals: dict[str, dict[str, int]] = {str(t): {"capacity_bytes": 0, "used_bytes": 0, "nodes": 0} for t in TIER_ORDER}
    for node in nodes:
        for tier in node.tiers.all():
            if node.state != NodeState.DOWN and tier.available:
                totals[tier.tier]["capacity_bytes"] += tier.capacity_bytes
                totals[tier.tier]["used_bytes"] += tier.used_bytes
                totals[tier.tier]["nodes"] += 1
    return {
        "seq": seq,
        "generated_at": timezone.now().isoformat(),
        "mode": policy.mode,
        "policy_version": policy.version,
        "nodes": [
            {
                **node_payload(node),
                "heartbeats": node.heartbeats,
                "registered_at": node.registered_at.isoformat(),
                "version": node.version,
                "pid": node.pid,
            }
            for node in nodes
        ],
        "tiers": [{"tier": tier, **totals[tier]} for tier in map(str, TIER_ORDER) if totals[tier]["nodes"]],
        "watermarks": {
            str(tier): {"high": policy.tier(tier).high_watermark, "low": policy.tier(tier).low_watermark}
            for tier in TIER_ORDER
        },
        "alerts": [dataclasses.asdict(alert) for alert in alerts_list(nodes=nodes, policy=policy)],
    }


# -- the nodes' engine servers ---------------------------------------------------------------------


class NodeUnreachable(Exception):
    """A node's engine server did not answer in time or answered something unreadable."""


class NodeNotContacted(Exception):
    """The control plane sent the node nothing: its address failed the check, or its credential
    is revoked."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A node's redirect is an answer, not a new address: following it would carry the node's
    key to wherever the node points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _node_get(node: Node, path: str, *, key: str | None) -> bytes:
    """GET `path` of `node`'s engine server with `key` (its operator endpoints need it), after
    checking the node's address (module docstring); NodeNotContacted when nothing was sent."""
    shown = f"http://{node.address}{path}"
    if key is None:
        raise NodeNotContacted(f"node {node.name}: its credential is revoked; nothing was sent to {node.address}")
    try:
        target = node_target(node.address, seen_from=node.seen_from, allowed=settings.STRATA_NODE_ADDRESSES)
    except AddressRefused as exc:
        raise NodeNotContacted(f"node {node.name}: {exc}") from exc
    headers = {"Host": target.host_header}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(target.base_url + path, headers=headers)
    try:
        with _OPENER.open(request, timeout=NODE_FETCH_TIMEOUT_S) as response:
            return bytes(response.read(MAX_FETCH_BYTES))
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise NodeUnreachable(
                f"{shown}: the node refused the control plane's key ({exc.code}): a node with a credential "
                "needs the admin key `strata_node_credential` issued with it (rotation issues a new one); "
                "for one without, set STRATA_NODE_ADMIN_KEY to the nodes' admin key"
            ) from exc
        raise NodeUnreachable(f"{shown}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NodeUnreachable(f"{shown}: {reason}") from exc


NodeFetch = Callable[[Node, Callable[[str], bytes]], dict[str, Any]]
"""Reads one node: called with the node and a GET of a path on it (`_node_get` with its key)."""


def _each_node(nodes: list[Node], fetch: NodeFetch) -> list[dict[str, Any]]:
    """Run `fetch` for every node with an engine server, at once; a failure becomes that node's error."""
    serving = [node for node in nodes if node.address and node.state != NodeState.DOWN]
    keys = node_admin_keys(nodes=[node.name for node in serving]) if serving else {}

    def one(node: Node) -> dict[str, Any]:
        try:
            return {
                "node": node.name,
                "error": "",
                **fetch(node, lambda path: _node_get(node, path, key=keys[node.name])),
            }
        except NodeNotContacted as exc:
            NODE_ADDRESS_REFUSED.labels(node=node.name).inc()
            log.warning("%s", exc)
            return {"node": node.name, "error": f"not contacted: {exc}"}
        except NodeUnreachable as exc:
            NODE_FETCH_FAILURES.labels(node=node.name).inc()
            log.info("node %s did not answer the dashboard: %s", node.name, exc)
            return {"node": node.name, "error": f"engine server unreachable: {exc}"}

    if not serving:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(serving)), thread_name_prefix="dashboard-fetch") as pool:
        return list(pool.map(one, serving))


def _serving_nodes(node: str | None) -> list[Node]:
    nodes = list(Node.objects.order_by("name"))
    return [n for n in nodes if n.name == node] if node else nodes


def requests_recent(*, node: str | None = None) -> dict[str, Any]:
    """The latest request timelines of every serving node (or one), newest first, with per-node errors."""

    def fetch(n: Node, get: Callable[[str], bytes]) -> dict[str, Any]:
        try:
            body = json.loads(get("/v1/strata/requests"))
        except json.JSONDecodeError as exc:
            raise NodeUnreachable(f"answer is not JSON ({exc})") from exc
        return {"requests": [{**trace, "node": n.name} for trace in body.get("requests", [])]}

    answers = _each_node(_serving_nodes(node), fetch)
    merged = [trace for answer in answers for trace in answer.pop("requests", [])]
    merged.sort(key=lambda t: t.get("started_at", 0.0), reverse=True)
    return {"requests": merged, "nodes": answers, "summary": requests_summary(merged)}


def requests_summary(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens served from cache vs recomputed, and the prefill time the cache saved.

    Saved time is estimated from the traces themselves: the measured prefill time per computed
    token, times the tokens served from the cache, less the time spent loading them."""
    prompt = sum(int(t.get("prompt_tokens", 0)) for t in traces)
    cached = sum(int(t.get("cached_tokens", 0)) for t in traces)
    computed = prompt - cached
    prefill_s = sum(float(t.get("prefill_s", 0.0)) for t in traces)
    load_s = sum(float(t.get("load_s", 0.0)) for t in traces)
    per_token = prefill_s / computed if computed > 0 else None
    saved = cached * per_token - load_s if per_token is not None else None
    prefix = sum(int(t.get("prefix_tokens", 0)) for t in traces)
    fragment = sum(int(t.get("fragment_tokens", 0)) for t in traces)
    recomputed = sum(int(t.get("recomputed_tokens", 0)) for t in traces)
    return {
        "requests": len(traces),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": computed,
        "prefill_seconds_per_token": per_token,
        "load_seconds": load_s,
        "saved_seconds": saved,
        "prefix_tokens": prefix,
        "fragment_tokens": fragment,
        "recomputed_tokens": recomputed,
        "recompute_ratio": recomputed / fragment if fragment else None,
    }


def _families(text: str) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        found.setdefault(family.name, []).extend(family.samples)
    return found


def _counter(families: dict[str, list[Any]], name: str) -> list[Any]:
    return [s for s in families.get(name, []) if s.name == f"{name}_total"]


def _gauge(families: dict[str, list[Any]], name: str) -> list[Any]:
    return [s for s in families.get(name, []) if s.name == name]


QUALITY_RESULTS = ("agreed", "disagreed", "dropped")


def _fragment_reuse(families: dict[str, list[Any]]) -> dict[str, Any]:
    """Fragment reuse of one node from its /metrics: reused tokens by kind (fragment positions
    include the recomputed ones), quality samples, and per namespace the current r and whether it
    fell back to prefix-only. A node too old to export a series reads as zero or absent."""
    reused = {"prefix": 0.0, "fragment": 0.0}
    for sample in _counter(families, "strata_reused_tokens"):
        reused[sample.labels["kind"]] = reused.get(sample.labels["kind"], 0.0) + sample.value
    recomputed = sum(s.value for s in _counter(families, "strata_blend_recomputed_tokens"))
    quality = dict.fromkeys(QUALITY_RESULTS, 0.0)
    for sample in _counter(families, "strata_blend_quality_samples"):
        quality[sample.labels["result"]] = quality.get(sample.labels["result"], 0.0) + sample.value
    enabled = _gauge(families, "strata_blend_enabled")
    defaults = _gauge(families, "strata_blend_default_recompute_percent")
    namespaces: dict[tuple[str, str], dict[str, Any]] = {}

    def row(sample: Any) -> dict[str, Any]:
        key = (sample.labels["model"], sample.labels["namespace"])
        return namespaces.setdefault(
            key,
            {
                "model": key[0],
                "namespace": key[1],
                "recompute_percent": None,
                "prefix_only": False,
                "samples": {"agreed": 0.0, "disagreed": 0.0},
                "window_agreement": None,
            },
        )

    for sample in _gauge(families, "strata_blend_recompute_percent"):
        row(sample)["recompute_percent"] = sample.value
    for sample in _gauge(families, "strata_blend_prefix_only"):
        row(sample)["prefix_only"] = sample.value >= 1
    for sample in _counter(families, "strata_blend_namespace_samples"):
        row(sample)["samples"][sample.labels["result"]] = sample.value
    for sample in _gauge(families, "strata_blend_window_agreement"):
        row(sample)["window_agreement"] = sample.value
    return {
        "enabled": any(s.value >= 1 for s in enabled),
        "model": enabled[0].labels["model"] if enabled else "",
        "default_recompute_percent": defaults[0].value if defaults else None,
        "reused_tokens": reused,
        "recomputed_tokens": recomputed,
        "recompute_ratio": recomputed / reused["fragment"] if reused["fragment"] else None,
        "quality_samples": quality,
        "namespaces": [namespaces[key] for key in sorted(namespaces)],
    }


def cache_stats(*, node: str | None = None) -> dict[str, Any]:
    """Cumulative cache counters of every serving node, read from its /metrics: tokens looked up,
    tokens served from cache and, split by the tier each hit block came from, hit tokens by tier;
    the blocks nodes evicted at write-back by reason (pressure, quota, ttl) and the write-backs
    refused for want of an evictable block; the reads from the remote tier refused because the
    copy's checksum was not the one the directory registered (`remote_unverified`); and fragment
    reuse: reused tokens by kind, the recompute ratio, quality samples, and the current r and
    fallback state of every (node, model, namespace)."""

    def fetch(n: Node, get: Callable[[str], bytes]) -> dict[str, Any]:
        try:
            families = _families(get("/metrics").decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise NodeUnreachable(f"metrics unreadable ({exc})") from exc

        def total(name: str) -> float:
            return sum(s.value for s in _counter(families, name))

        lookup, hits = total("strata_lookup_tokens"), total("strata_hit_tokens")
        blocks = {s.labels["tier"]: s.value for s in _counter(families, "strata_hit_blocks")}
        all_blocks = sum(blocks.values())
        # Every hit is a whole block, so a tier's share of hit blocks is its share of hit tokens.
        by_tier = {tier: hits * count / all_blocks for tier, count in blocks.items()} if all_blocks else {}
        evictions: dict[str, float] = {}
        for sample in _counter(families, "strata_evictions"):
            evictions[sample.labels["reason"]] = evictions.get(sample.labels["reason"], 0.0) + sample.value
        return {
            "lookup_tokens": lookup,
            "hit_tokens": hits,
            "hit_blocks_by_tier": blocks,
            "hit_tokens_by_tier": by_tier,
            "evictions_by_reason": evictions,
            "write_backs_refused": total("strata_write_back_refused"),
            "remote_unverified": total("strata_remote_unverified"),
            "fragment_reuse": _fragment_reuse(families),
        }

    answers = _each_node(_serving_nodes(node), fetch)
    fleet_by_tier: dict[str, float] = {}
    fleet_evictions: dict[str, float] = {}
    for answer in answers:
        for tier, tokens in answer.get("hit_tokens_by_tier", {}).items():
            fleet_by_tier[tier] = fleet_by_tier.get(tier, 0.0) + tokens
        for reason, count in answer.get("evictions_by_reason", {}).items():
            fleet_evictions[reason] = fleet_evictions.get(reason, 0.0) + count
    return {
        "generated_at": timezone.now().isoformat(),
        "nodes": answers,
        "lookup_tokens": sum(a.get("lookup_tokens", 0.0) for a in answers),
        "hit_tokens": sum(a.get("hit_tokens", 0.0) for a in answers),
        "hit_tokens_by_tier": fleet_by_tier,
        "evictions_by_reason": fleet_evictions,
        "write_backs_refused": sum(a.get("write_backs_refused", 0.0) for a in answers),
        "remote_unverified": sum(a.get("remote_unverified", 0.0) for a in answers),
        "fragment_reuse": _fleet_fragment_reuse(answers),
    }


def _fleet_fragment_reuse(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The nodes' fragment reuse summed, with every node's settings and namespaces side by side."""
    reached = [(a["node"], a["fragment_reuse"]) for a in answers if "fragment_reuse" in a]
    reused = {kind: sum(f["reused_tokens"].get(kind, 0.0) for _, f in reached) for kind in ("prefix", "fragment")}
    recomputed = sum(f["recomputed_tokens"] for _, f in reached)
    return {
        "reused_tokens": reused,
        "recomputed_tokens": recomputed,
        "recompute_ratio": recomputed / reused["fragment"] if reused["fragment"] else None,
        "quality_samples": {
            result: sum(f["quality_samples"].get(result, 0.0) for _, f in reached) for result in QUALITY_RESULTS
        },
        "nodes": [
            {
                "node": name,
                "model": f["model"],
                "enabled": f["enabled"],
                "default_recompute_percent": f["default_recompute_percent"],
            }
            for name, f in reached
        ],
        "namespaces": [{"node": name, **row} for name, f in reached for row in f["namespaces"]],
    }


def blocks_by_fingerprint(*, key: uuid.UUID, limit: int = 100) -> list[Block]:
    """Blocks whose prefix key or content key is `key` (one content key may occur in many prompts
    and namespaces; a prefix key in one per namespace and model). Both columns are indexed."""
    return list(
        Block.objects.select_related("namespace", "model")
        .filter(Q(prefix_key=key) | Q(content_key=key))
        .order_by("-id")[:limit]
    )
