"""Prometheus counters of movements, read at scrape time from the tally table (a few dozen rows,
upserted as movements finish; the ledger itself is never counted)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from controlplane.movements.choices import TALLY_SCRUB, MovementKind
from controlplane.movements.selectors import movement_tallies


class MovementsCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
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
