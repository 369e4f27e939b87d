"""The directory as the data plane sees it: a Protocol and the small dataclasses it exchanges (no Django).

The directory is the control plane's ledger of which block is where (PostgreSQL). The data plane
asks it one thing synchronously - where the blocks of a prompt are - and tells it everything else
(new blocks, changed copies, accesses) without waiting: writes go out in batches, behind the
request path. The Django-backed implementation lives in `worker.postgres_directory`.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol

from worker.dataplane.errors import DataplaneError
from worker.dataplane.tier_names import REMOTE, TIER_ORDER

ENGINES: tuple[str, ...] = ("strata", "vllm")
"""The engines a node can serve with (its `engine` option, recorded on its directory row)."""

DEFAULT_CLASS = "default"
"""The priority class of every namespace that no class names."""


PLACEMENT_STATES: tuple[str, ...] = ("pending", "ready", "corrupt", "deleting")

PlacementAction = Literal["corrupt", "deleting", "delete"]
PLACEMENT_ACTIONS: tuple[str, ...] = ("corrupt", "deleting", "delete")

MAX_BATCH = 4096
"""Most keys one lookup (or blocks one registration) may carry: the REST API refuses more, the
Directory splits nothing. The control plane imports this limit (`directory.choices.MAX_BATCH`)."""

_HEX_CHECKSUM = re.compile(r"^[0-9a-f]{32}$")


def check_checksum(value: object, *, what: str = "checksum") -> None:
    """ValueError naming `what` unless `value` is a block checksum as the directory records it
    (`BlockChecksum.hex`: 32 lower-case hex characters) or "" (none)."""
    if not isinstance(value, str) or (value and not _HEX_CHECKSUM.match(value)):
        raise ValueError(f"{what}: expected 32 lower-case hex characters (xxh3-128) or nothing, got {value!r}")


class DirectoryUnavailable(DataplaneError):
    """The directory could not answer in time (database down or slow): treat every key as a miss."""


def _check_tier_node(tier: str, node: str | None) -> None:
    if tier not in TIER_ORDER:
        raise ValueError(f"tier: unknown tier {tier!r}; expected one of {', '.join(TIER_ORDER)}")
    if tier == REMOTE and node:
        raise ValueError("node: a remote placement belongs to no node; leave node empty")
    if tier != REMOTE and not node:
        raise ValueError(f"node: a {tier} placement needs the node that holds it")


def _check_not_negative(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: must be an integer of at least 0, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where the best READY copy of one asked key is, and which block it is."""

    key: uuid.UUID
    """The key that was asked (a prefix key, or a content key for fragment matches)."""
    prefix_key: uuid.UUID
    content_key: uuid.UUID
    position: int
    """Offset of the block's first token in the chain it was registered in (for RoPE re-alignment)."""
    tokens: int
    block_id: int
    placement_id: int
    tier: str
    node: str | None
    locator: str
    offset: int
    nbytes: int
    checksum: str
    epoch: int
    """Version of the placement; a change sent with it is refused if the placement moved on since."""
    remote_checksum: str = ""
    """The checksum of the block's READY copy in the shared remote tier ("" when it has none):
    `checksum` when that copy is the best one, else the one a read from L3 must find when the
    best copy turns out gone (a copy of the asking node that its tiers no longer hold)."""


@dataclasses.dataclass(frozen=True)
class LookupResult(Mapping[uuid.UUID, str]):
    """The answer to one lookup: per asked key, in the order asked, its location or None (a miss).

    It is also a read-only mapping key -> tier of every hit, so a caller that only needs "which
    tier" can use it as such."""

    prefix: tuple[BlockLocation | None, ...]
    content: tuple[BlockLocation | None, ...] = ()

    @property
    def prefix_hit_blocks(self) -> int:
        """Length of the leading run of prefix hits: chained keys cannot hit after a miss."""
        count = 0
        for location in self.prefix:
            if location is None:
                break
            count += 1
        return count

    @property
    def hits(self) -> int:
        return sum(1 for loc in (*self.prefix, *self.content) if loc is not None)

    def location(self, key: uuid.UUID) -> BlockLocation | None:
        return self._by_key().get(key)

    def _by_key(self) -> dict[uuid.UUID, BlockLocation]:
        cached = self.__dict__.get("_index")
        if cached is None:
            cached = {loc.key: loc for loc in (*self.prefix, *self.content) if loc is not None}
            object.__setattr__(self, "_index", cached)
        return cached

    def __getitem__(self, key: uuid.UUID) -> str:
        return self._by_key()[key].tier

    def __iter__(self) -> Iterator[uuid.UUID]:
        return iter(self._by_key())

    def __len__(self) -> int:
        return len(self._by_key())


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRegistration:
    """A block the node holds and one READY copy of it, to record in the directory."""

    namespace: str
    model_key: uuid.UUID
    prefix_key: uuid.UUID
    content_key: uuid.UUID
    position: int
    tokens: int
    tier: str
    node: str | None
    nbytes: int
    checksum: str = ""
    """xxh3-128 of key and bytes as 32 hex characters; empty for device copies (L1 is not verified)."""
    locator: str = ""
    """Path, object key or slot in the tier; empty when the tier derives it from the key."""
    offset: int = 0
    priority: str = "default"

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace: cannot be empty")
        _check_tier_node(self.tier, self.node)
        _check_not_negative(position=self.position, nbytes=self.nbytes, offset=self.offset)
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens: a block has at least one token, got {self.tokens!r}")
        if self.checksum and not _HEX_CHECKSUM.match(self.checksum):
            raise ValueError("checksum: expected 32 lower-case hex characters (xxh3-128)")
        if len(self.locator) > 1024:
            raise ValueError("locator: at most 1024 characters")

    @classmethod
    def coerce(cls, block: object) -> BlockRegistration:
        """A registration from any object with the same attribute names (e.g. the engine's
        StoredBlock, which lacks the optional ones)."""
        if isinstance(block, cls):
            return block
        fields = {f.name: getattr(block, f.name) for f in dataclasses.fields(cls) if hasattr(block, f.name)}
        return cls(**fields)


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementChange:
    """A change to one copy of a block, addressed by key, tier and node (the data plane never
    learns database ids of what it registered write-behind).

    `expected_epoch` guards the change: when set and the placement's epoch differs, the change
    is refused (and counted) because someone else changed the copy since it was read."""

    namespace: str
    model_key: uuid.UUID
    prefix_key: uuid.UUID
    tier: str
    node: str | None
    action: PlacementAction
    expected_epoch: int | None = None

    def __post_init__(self) -> None:
        _check_tier_node(self.tier, self.node)
        if self.action not in PLACEMENT_ACTIONS:
            raise ValueError(f"action: unknown action {self.action!r}; expected one of {', '.join(PLACEMENT_ACTIONS)}")
        if self.expected_epoch is not None:
            _check_not_negative(expected_epoch=self.expected_epoch)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockTouch:
    """`hits` accesses of a block, the last at `at` (unix seconds); feeds the hotness ranking."""

    namespace: str
    model_key: uuid.UUID
    prefix_key: uuid.UUID
    hits: int = 1
    at: float = dataclasses.field(default_factory=time.time)

    def __post_init__(self) -> None:
        if isinstance(self.hits, bool) or not isinstance(self.hits, int) or self.hits <= 0:
            raise ValueError(f"hits: must be a positive integer, got {self.hits!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class DirectoryStats:
    """Counters of a directory client since it started (plain numbers for logs and metrics)."""

    queued: int = 0
    """Registrations, placement changes and touches accepted (never blocking the caller)."""
    pending: int = 0
    """Writes accepted but not yet in the database (held through an outage)."""
    flushed: int = 0
    """Writes committed."""
    flushes: int = 0
    """Batches committed."""
    retried: int = 0
    """Writes whose batch failed and that were kept to try again."""
    failed_flushes: int = 0
    dropped_touches: int = 0
    """Touches given up: over capacity, or lost with a failed batch (hotness is best effort)."""
    rejected: int = 0
    """Writes the database refused for good (unknown namespace, model or node; bad data)."""
    refused_changes: int = 0
    """Placement changes refused by the epoch guard or aimed at a copy that is not there."""
    over_capacity: int = 0
    """Registrations or changes accepted while the queue was over capacity (kept, never dropped)."""
    lookups: int = 0
    lookup_failures: int = 0
    read_deadlines: int = 0
    """Reads (lookups, salts) cut because no answer came by their deadline."""
    write_deadlines: int = 0
    """Writes cut because no answer came by their deadline (retried)."""
    deferred: int = 0
    """Registrations held because they name a namespace, model or node not known yet (retried)."""
    primary_reads: int = 0
    """Reads (lookups, salts) answered by the primary database."""
    replica_reads: int = 0
    """Reads answered by the read replica (within its staleness bound)."""
    replica_lag_fallbacks: int = 0
    """Reads sent to the primary because the replica's measured staleness was over the bound."""
    replica_failure_fallbacks: int = 0
    """Reads sent to the primary because the replica failed or was unreachable."""
    replica_staleness_s: float | None = None
    """How far behind the primary the replica may be, at most, as last measured (inf before the
    first measurement; None without a replica)."""


class Directory(Protocol):
    """What the data plane asks of the block directory."""

    def lookup(
        self,
        *,
        keys: Sequence[uuid.UUID],
        node: str | None,
        namespace: str | None = None,
        model_key: uuid.UUID | None = None,
        content_keys: Sequence[uuid.UUID] = (),
    ) -> LookupResult:
        """The best READY copy `node` can read of each key (its own device, host, disk, then the
        shared remote tier), with the checksum of the block's READY copy in the remote tier
        (`BlockLocation.remote_checksum`), in one round trip. Only blocks of `namespace` (and of
        shared namespaces) and of `model_key` match; None means any. Raises DirectoryUnavailable
        quickly when the directory cannot answer, so the caller recomputes instead of waiting."""
        ...

    def register(self, *, blocks: Sequence[BlockRegistration]) -> None:
        """Record blocks and their READY copies. Returns at once; the writes are kept and retried
        until the database takes them (never dropped while the process lives)."""
        ...

    def change_placements(self, *, changes: Sequence[PlacementChange]) -> None:
        """Mark copies corrupt or being deleted, or remove them. Returns at once; applied in
        order after the registrations queued before them."""
        ...

    def touch(self, *, touches: Sequence[BlockTouch]) -> None:
        """Count accesses. Returns at once; may be dropped (and counted) under pressure."""
        ...

    def namespace_salt(self, namespace: str) -> bytes:
        """The salt a namespace hashes into its keys (a synchronous read, cached)."""
        ...

    def shared_salts(self) -> dict[str, bytes]:
        """The salt of every shared namespace, by name: blocks any namespace may reuse (a read
        cached briefly, so a namespace newly marked shared is matched within seconds)."""
        ...

    def flush(self, *, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is written; False if `timeout` passed first."""
        ...

    def stats(self) -> DirectoryStats:
        """The counters above, as of now."""
        ...

    def close(self) -> None:
        """Write what is queued (briefly), stop the writer, close connections."""
        ...
