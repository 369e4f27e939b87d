"""What the connector's two halves tell each other, pickled between vLLM's processes: each step's
work, scheduler -> worker (`StrataMetadata`: the loads and saves), and what the step measured,
worker -> scheduler (`StrataWorkerMeta`)."""

from __future__ import annotations

import dataclasses
import uuid

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from worker.dataplane.blend.matching import Fragment


@dataclasses.dataclass
class BlendSpec:
    """A load assembled by selective recompute (`blend_load`): the prompt's tokens up to the load's
    end, its exact prefix [0, prefix_len) (whole blocks: those in `prefix` read from the tiers,
    the others from the request's pages), the fragments, and r, selection and check layer."""

    tokens: list[int]
    prefix_len: int
    prefix: dict[int, tuple[uuid.UUID, str, str]]
    """Block index -> (key, tier, checksum) of the prefix blocks vLLM's pages do not hold."""
    fragments: list[Fragment]
    percent: float
    selection: str
    check_layer: int
    sample_tokens: list[int] | None = None
    """The whole prompt, where this load is sampled for the quality check (`blend_checks`): its
    blended answer is compared with a full prefill's, off the request's path."""


@dataclasses.dataclass
class LoadSpec:
    """Load tokens [start, end) of a request into its pages: they lie in the blocks `keys`, which
    are the request's blocks first_block, first_block + 1, ... (in `tiers`; a copy of block i read
    from the remote tier must carry `checksums[i]`, see `offload.Hit.checksum`)."""

    request_id: str
    namespace: str
    keys: list[uuid.UUID]
    tiers: list[str]
    checksums: list[str]
    first_block: int
    start: int
    end: int
    pages: list[int]
    refused: str = ""
    """Why the scheduler could not plan this load ("" for a load to make): the worker reads
    nothing and reports the pages [start, end) as failed, so vLLM recomputes them."""
    asynchronous: bool = False
    """Loaded outside the engine step (the request waits in vLLM until the worker reports it
    finished), not layer by layer inside it."""
    blend: BlendSpec | None = None
    """Tokens [start, end) assembled from the prefix and fragments by selective recompute,
    whole, before the step's forward pass (`keys` is then empty)."""


@dataclasses.dataclass
class SaveSpec:
    """Save full blocks of a request from its pages: (index in the request, prefix key, content key)."""

    request_id: str
    namespace: str
    blocks: list[tuple[int, uuid.UUID, uuid.UUID]]
    pages: list[int]


@dataclasses.dataclass
class StrataMetadata(KVConnectorMetadata):
    """One step's work for the worker half."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    prefills_done: list[str] = dataclasses.field(default_factory=list)
    """Requests whose prefill this step completes (echoed back: their first token is out then)."""
    scheduled_tokens: int = 0
    step: int = 0
    """This step's number (1, 2, ... in the order the scheduler half planned them)."""
    reported: int = 0
    """The last step whose worker report the scheduler half had read when it planned this one: a
    load that failed in a later step was unknown to this plan (`failed_pages`)."""
    aborted: list[str] = dataclasses.field(default_factory=list)
    """Requests that ended while their asynchronous load runs: the worker gives the load up, so
    that vLLM frees their pages now."""


@dataclasses.dataclass
class LoadReport:
    """How one request's load went, as the worker saw it."""

    stalls: list[float]
    loaded_at: list[float]
    load_s: float
    tier_loads: list[tuple[str, int, float]]
    blocks_by_tier: dict[str, int]
    failure: str = ""


@dataclasses.dataclass
class StrataWorkerMeta(KVConnectorWorkerMetadata):
    """One step's results, from the worker half back to the scheduler half."""

    loads: dict[str, LoadReport] = dataclasses.field(default_factory=dict)
    saved: dict[str, int] = dataclasses.field(default_factory=dict)
    prefills_done: list[str] = dataclasses.field(default_factory=list)
    prefill: tuple[int, float] | None = None
    """(tokens, seconds) of a step that loaded nothing: what the prefill speed is learned from."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The worker's counters since its last report (loads, hits, write-back, quarantines)."""
    store_events: dict[str, int] = dataclasses.field(default_factory=dict)
    """Its store's tier events since its last report (corrupt, unavailable, ...)."""
    tier_changes: list[tuple[str, str, uuid.UUID]] = dataclasses.field(default_factory=list)
    """The copies it stored or dropped since its last report, in order: (stored or removed, tier,
    key); only where vLLM publishes KV events (`kv_events`)."""
    step: int = 0
    """The step this report ends (`StrataMetadata.step`)."""
    blend_samples: list[tuple[str, float, bool, float]] = dataclasses.field(default_factory=list)
    """Quality samples judged since the last report: (namespace, r it was blended at, whether the
    blended answer agreed with the full prefill's, KL(full || blended))."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Fold another rank's report of the same step into this one. The ranks of a tensor-parallel
        group load the same blocks, so a load failed when it failed on any rank (vLLM recomputes
        its pages on every rank), its stalls are the slowest rank's, and a counter is the largest
        any rank counted (summing would count each hit once per rank); only the first rank
        stores blocks (`saved`, `tier_changes`; a block quarantined on several ranks counts once)."""
        if not isinstance(other, StrataWorkerMeta):
            return self
        self.step = max(self.step, other.step)
        for request_id, theirs in other.loads.items():
            mine = self.loads.get(request_id)
            if mine is None or (theirs.failure and not mine.failure):
                self.loads[request_id] = theirs
            elif not mine.failure and not theirs.failure:
                mine.stalls = [max(a, b) for a, b in zip(mine.stalls, theirs.stalls, strict=False)] or theirs.stalls
        for name, count in other.saved.items():
            self.saved[name] = self.saved.get(name, 0) + count
        self.prefills_done.extend(r for r in other.prefills_done if r not in self.prefills_done)
        self.prefill = self.prefill or other.prefill
        self.tier_changes.extend(change for change in other.tier_changes if change not in self.tier_changes)
        self.blend_samples.extend(other.blend_samples)  # blending serves one rank: only it judges samples
        for mine_counts, theirs_counts in ((self.counts, other.counts), (self.store_events, other.store_events)):
            for name, count in theirs_counts.items():
                mine_counts[name] = max(mine_counts.get(name, 0), count)
        return self
