"""What the offload manager's lookups, decisions and loads produce, for the engines and connectors that
call it: the hits a lookup finds (and the shared chain they may follow), the load-or-recompute
decision, what each tier served a load, the speed estimates behind the decision, and the timeline
of one request."""

from __future__ import annotations

import dataclasses
import time
import uuid

from worker.dataplane.directory import check_checksum
from worker.dataplane.hashing import BlockFingerprint


@dataclasses.dataclass(frozen=True)
class Hit:
    """One block of the prompt found in a tier."""

    index: int
    """Position of the block in the prompt (0 = first)."""
    key: uuid.UUID
    tier: str
    namespace: str = ""
    """The shared namespace the block belongs to; "" for the request's own namespace."""
    checksum: str = ""
    """The checksum (hex, `BlockChecksum.hex`) the directory registered for the block's copy in
    the shared remote tier: a read of the block from that tier is served only when the copy
    carries it (`LayerLoader`, `verify_remote`). "" when the directory named none: a hit in the
    node's own tiers, or any hit of a manager without a directory."""

    def __post_init__(self) -> None:
        check_checksum(self.checksum, what=f"checksum of hit {self.index} (block {self.key})")


@dataclasses.dataclass(frozen=True)
class Chain:
    """Where a prompt's chain of prefix keys comes from: its leading blocks may be a shared
    namespace's (a system prompt, a common document), hashed with that namespace's salt; the
    blocks after them are the request's own, chained on from the last shared key with the
    request namespace's salt. Without a shared lead, the whole chain is the request's own."""

    shared: str = ""
    """The shared namespace whose blocks lead the prompt ("" for none)."""
    lead: tuple[BlockFingerprint, ...] = ()
    """Those leading blocks' fingerprints, under the shared namespace's salt."""


@dataclasses.dataclass(frozen=True)
class TierLoad:
    """What one tier contributed to a load: the bytes it served and the seconds it took."""

    tier: str
    bytes: int
    seconds: float


class Throughput:
    """An exponentially weighted estimate of a rate (bytes/s of a tier, tokens/s of prefill).

    `measured_at` is the clock reading of the last observation. An observation made more than
    `stale_after` seconds after the one before replaces the estimate instead of blending into it:
    a medium not read for that long may have changed (a throttle lifted, a neighbour gone), and
    an old average would hold back what the new reading says."""

    def __init__(self, initial: float | None = None, weight: float = 0.3, *, stale_after: float | None = None) -> None:
        self.value = initial
        self.weight = weight
        self.stale_after = stale_after
        self.measured_at: float | None = None

    def observe(self, amount: float, seconds: float, *, now: float | None = None) -> None:
        if seconds <= 0 or amount <= 0:
            return
        rate = amount / seconds
        now = time.monotonic() if now is None else now
        stale = self.is_stale(now)
        self.value = rate if self.value is None or stale else (1 - self.weight) * self.value + self.weight * rate
        self.measured_at = now

    def age(self, now: float) -> float | None:
        """Seconds since the last observation (None: never observed)."""
        return None if self.measured_at is None else now - self.measured_at

    def is_stale(self, now: float) -> bool:
        """Whether the estimate is older than `stale_after` (never, without a `stale_after`)."""
        age = self.age(now)
        return self.stale_after is not None and age is not None and age >= self.stale_after


@dataclasses.dataclass
class RequestTrace:
    """What happened to one request: where each block came from and where time went."""

    request_id: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int = 0
    hit_blocks_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    decision: str = "no-hit"
    layerwise: bool = True
    load_failures: int = 0
    lookup_s: float = 0.0
    ttft_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str = "length"
    layer_stall_s: list[float] = dataclasses.field(default_factory=list)
    layer_loaded_at_s: list[float] = dataclasses.field(default_factory=list)
    written_blocks: int = 0
    started_at: float = 0.0
    prefix_tokens: int = 0
    """Reused tokens of the leading run of prefix blocks (exact reuse)."""
    fragment_tokens: int = 0
    """Tokens of fragments reused from elsewhere in the prompt (re-aligned, partly recomputed)."""
    recomputed_tokens: int = 0
    """Fragment tokens recomputed by selective recompute."""
    recompute_ratio: float = 0.0
    """recomputed_tokens / fragment_tokens (0 without fragments)."""
    fragment_blocks_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    blend: str = "off"
    """off (not enabled or not asked), blend, prefix-only (fallen back for the namespace), or no-fragment."""
    blend_percent: float = 0.0
    """The namespace's r when the request ran."""
    segments: int = 0
    uncached: str = ""
    """Why the request was served without the cache (prompt_embeds, multimodal, adapter, namespace,
    field.<name>); "" when it was not."""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Load the hits or recompute them, and the two estimates behind the choice."""

    choice: str
    """no-hit, load or recompute."""
    load_s: float | None = None
    compute_s: float | None = None
    reprobe: tuple[str, ...] = ()
    """Tiers loaded although their estimate said recompute, to measure them again (see `decide`)."""
