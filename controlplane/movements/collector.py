"""Prometheus counters of movements, read at scrape time from the tally table (a few dozen rows,
upserted as movements finish; the ledger itself is never counted), and the reconcile job's
recounts of tier usage counters (a row per node and tier)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.movements.choices import TALLY_SCRUB, MovementKind
from controlplane.movements.selectors import movement_tallies, tier_recounts


class MovementsCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        moved = CounterMetricFamily(
            "strata_blocks_moved",
            "Blocks moved or warmed between tiers, by result.",
            labels=["src_tier", "dst_tier", "result"],
        )
        moved_bytes = CounterMetricFamily(
            "strata_bytes_moved", "Bytes moved or warmed between tiers.", labels=["src_tier", "dst_tier"]
        )
        evictions = CounterMetricFamily(
            "strata_evictions", "Copies evicted (freed with no tier below), by reason.", labels=["tier", "reason"]
        )
        failures = CounterMetricFamily(
            "strata_checksum_failures",
            "Copies found corrupt or missing (by scrub, move or reconcile), quarantined.",
            labels=["tier", "found_by"],
        )
        blocks: dict[tuple[str, ...], int] = defaultdict(int)
        nbytes: dict[tuple[str, ...], int] = defaultdict(int)
        evicted: dict[tuple[str, ...], int] = defaultdict(int)
        corrupt: dict[tuple[str, ...], int] = defaultdict(int)
        for t in movement_tallies():
            if t.kind == TALLY_SCRUB:
                corrupt[(t.src_tier, t.reason)] += t.blocks
            elif t.kind == MovementKind.EVICT:
                if t.result == "done":
                    evicted[(t.src_tier, t.reason)] += t.blocks
            else:
                blocks[(t.src_tier, t.dst_tier, t.result)] += t.blocks
                nbytes[(t.src_tier, t.dst_tier)] += t.bytes
        for labels, value in sorted(blocks.items()):
            moved.add_metric(list(labels), float(value))
        for labels, value in sorted(nbytes.items()):
            moved_bytes.add_metric(list(labels), float(value))
        for labels, value in sorted(evicted.items()):
            evictions.add_metric(list(labels), float(value))
        for labels, value in sorted(corrupt.items()):
            failures.add_metric(list(labels), float(value))
        yield moved
        yield moved_bytes
        yield evictions
        yield failures
        yield from self._recounts()

    def _recounts(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per node and tier (no node: the shared remote tier): the drift the last recount found
        and corrected, and how many recounts corrected one."""
        drift = GaugeMetricFamily(
            "strata_tier_accounting_drift_bytes",
            "Usage counted minus held, as the last recount of the tier's counters found it (then corrected); "
            "positive: bytes counted that were not there.",
            labels=["node", "tier"],
        )
        drift_blocks = GaugeMetricFamily(
            "strata_tier_accounting_drift_blocks",
            "Blocks counted minus held, as the last recount of the tier's counters found it (then corrected).",
            labels=["node", "tier"],
        )
        corrections = CounterMetricFamily(
            "strata_tier_accounting_corrections",
            "Recounts of a tier's usage counters that found them off and corrected them.",
            labels=["node", "tier"],
        )
        corrected = CounterMetricFamily(
            "strata_tier_accounting_corrected_bytes",
            "Bytes of drift corrected by recounts of a tier's usage counters (either way).",
            labels=["node", "tier"],
        )
        recounted = GaugeMetricFamily(
            "strata_tier_accounting_recounted_timestamp_seconds",
            "When the tier's usage counters were last recounted (Unix time).",
            labels=["node", "tier"],
        )
        for row in tier_recounts():
            labels = [row.node, row.tier]
            drift.add_metric(labels, float(row.drift_bytes))
            drift_blocks.add_metric(labels, float(row.drift_blocks))
            corrections.add_metric(labels, float(row.corrections))
            corrected.add_metric(labels, float(row.corrected_bytes))
            recounted.add_metric(labels, row.recounted_at.timestamp())
        yield from (drift, drift_blocks, corrections, corrected, recounted)
