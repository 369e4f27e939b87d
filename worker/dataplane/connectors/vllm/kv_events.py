"""Strata's tiers in vLLM's KV events: a block stored in a Strata tier is announced as vLLM's
`BlockStored` with medium "strata-<tier>" (strata-host, strata-disk, strata-remote), and a copy the
node drops as `BlockRemoved`, on the publisher vLLM runs for --kv-events-config, beside the events
of its GPU pages: a KV-aware router sees what each node's Strata holds.

    scheduler half  plans a save: BlockEvents.planned(request, blocks) keeps each block's payload
                    while vLLM's Request is alive (vLLM's hashes of its pages, the parent page's
                    hash, its tokens, the adapter, the extra keys)
    worker half     its manager tells TierChanges of each copy it stores (write-back, write-through
                    to L3) or drops (evicted at write-back or for its TTL, quarantined as corrupt);
                    the changes travel in the step's report (StrataWorkerMeta.tier_changes)
    scheduler half  BlockEvents.reported(changes) -> BlockStored / BlockRemoved, which vLLM takes
                    after each step (`take_events`) and publishes with its own

An event names the block by vLLM's page hashes (one per page of vLLM's block size, as vLLM's own
events do), not by Strata's keys, so a router matches it against the prompts it routes.

What the engine does not see is not announced: copies a Celery worker moves, evicts or scrubs on
the node, another engine's stores into a shared tier, the reconciler's deletions (other
processes), and the removal of a block whose payload was forgotten (the oldest past
`PAYLOADS`). The worker's changes reach the scheduler with its next step's report: an engine with
nothing to run publishes them with the next request.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from worker.dataplane.hashing import BlockFingerprint
from worker.dataplane.tier_names import REMOTE

log = logging.getLogger("strata.vllm")

STORED, REMOVED = "stored", "removed"
PAYLOADS = 1 << 13
"""Blocks whose payload is kept, newest first: a block stored since is announced stored and later removed."""
MEDIUM_PREFIX = "strata-"

TierChange = tuple[str, str, uuid.UUID]
"""(STORED or REMOVED, tier, block key)."""


def medium(tier: str) -> str:
    """The medium an event names a Strata tier by."""
    return f"{MEDIUM_PREFIX}{tier}"


class TierChanges:
    """The worker half's side: the copies its manager stored in a tier or dropped from one since
    the last `take`, in order (the manager's `copies`; the save queue's and write-through threads
    tell it too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: list[TierChange] = []

    def stored(self, tier: str, keys: Sequence[uuid.UUID]) -> None:
        with self._lock:
            self._changes.extend((STORED, tier, key) for key in keys)

    def removed(self, tier: str, key: uuid.UUID) -> None:
        with self._lock:
            self._changes.append((REMOVED, tier, key))

    def take(self) -> list[TierChange]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes


@dataclasses.dataclass
class Payload:
    """What an event says of one Strata block: vLLM's hashes of its pages and the rest of
    vLLM's BlockStored, and the tiers it was announced in."""

    hashes: list[Any]
    parent: Any
    tokens: array.array[int]
    """Its tokens (8 bytes each: the payloads of many blocks are kept)."""
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    session_id: str | None
    tiers: set[str] = dataclasses.field(default_factory=set)


class BlockEvents:
    """The scheduler half's side: the payloads of the blocks it asked the worker to save, and the
    events of the changes the worker reported, until vLLM takes them."""

    def __init__(self, *, block_tokens: int, page_tokens: int, capacity: int = PAYLOADS) -> None:
        if block_tokens % page_tokens:
            raise ValueError(f"vLLM's block size {page_tokens} must divide Strata's block_tokens {block_tokens}")
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.hash_block_tokens = page_tokens
        """The block size vLLM hashes requests by (its cache manager's; the page size unless bound)."""
        self.capacity = capacity
        self.payloads: collections.OrderedDict[uuid.UUID, Payload] = collections.OrderedDict()
        self.events: list[KVCacheEvent] = []

    def planned(self, request: Any, blocks: Sequence[BlockFingerprint]) -> None:
        """The worker is to save `blocks` of vLLM's `request`: keep what their events will say (a
        payload that cannot be built leaves its block unannounced, and a log line; never a lost save)."""
        try:
            self._keep(request, blocks)
        except Exception:  # noqa: BLE001 - events only
            log.exception("request %s: its blocks' KV events could not be prepared", request.request_id)

    def _keep(self, request: Any, blocks: Sequence[BlockFingerprint]) -> None:
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_tokens, self.page_tokens)
        per_block = self.block_tokens // self.page_tokens
        tokens = request.all_token_ids
        lora = request.lora_request
        for block in blocks:
            first = block.start // self.page_tokens
            pages = list(hashes[first : first + per_block])
            if len(pages) < per_block:  # vLLM has not hashed these pages: nothing names them
                continue
            extra = [
                generate_block_hash_extra_keys(request, start, start + self.page_tokens, 0)[0]
                for start in range(block.start, block.start + self.block_tokens, self.page_tokens)
            ]
            self.payloads[block.prefix_key] = Payload(
                hashes=[maybe_convert_block_hash(h) for h in pages],
                parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                tokens=array.array("q", tokens[block.start : block.start + self.block_tokens]),
                lora_id=lora.adapter_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
                extra_keys=to_event_extra_keys(extra),
                session_id=request.session_id,
                tiers=self.payloads[block.prefix_key].tiers if block.prefix_key in self.payloads else set(),
            )
            self.payloads.move_to_end(block.prefix_key)
        while len(self.payloads) > self.capacity:
            self.payloads.popitem(last=False)

    def reported(self, changes: Iterable[TierChange]) -> None:
        """The worker's changes, as events (a block without a payload is not announced)."""
        for action, tier, key in changes:
            payload = self.payloads.get(key)
            if payload is None:
                log.debug("block %s %s in tier %s: no payload, not announced", key, action, tier)
                continue
            locality = "REMOTE" if tier == REMOTE else "LOCAL"
            if action == STORED:
                payload.tiers.add(tier)
                self.events.append(
                    BlockStored(
                        block_hashes=list(payload.hashes),
                        parent_block_hash=payload.parent,
                        token_ids=payload.tokens.tolist(),
                        block_size=self.page_tokens,
                        lora_id=payload.lora_id,
                        medium=medium(tier),
                        lora_name=payload.lora_name,
                        extra_keys=payload.extra_keys,
                        group_idx=0,
                        locality=locality,
                        session_id=payload.session_id,
                    )
                )
            elif tier in payload.tiers:
                payload.tiers.discard(tier)
                self.events.append(
                    BlockRemoved(block_hashes=list(payload.hashes), medium=medium(tier), group_idx=0, locality=locality)
                )

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events
