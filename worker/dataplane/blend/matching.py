"""Finding reusable fragments anywhere in a prompt: a rolling content-key scan, then a non-overlapping choice.

Every stored block carries a position-independent content key. A new prompt is scanned window
by window (every token offset, block-sized windows); each window whose content key is known -
in this node's own index or in the directory - is a candidate. The chosen fragments are the
non-overlapping set that reuses the most blocks, the faster tiers winning ties.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from worker.dataplane.blend.options import BlendError
from worker.dataplane.counters import Counters
from worker.dataplane.directory import MAX_BATCH
from worker.dataplane.hashing import _content_key_raw, encode_tokens
from worker.dataplane.tier_names import TIER_ORDER

_PERSON_FRAGMENT = b"strata/fragmnt/1"
TIER_RANK = {tier: rank for rank, tier in enumerate(TIER_ORDER)}


@dataclasses.dataclass(frozen=True)
class Fragment:
    """A stored block whose tokens equal the prompt's tokens at [start, start + tokens)."""

    start: int
    """Where the window starts in the new prompt."""
    tokens: int
    key: uuid.UUID
    """The key its bytes are stored under in the tiers."""
    source_position: int
    """Where its first token sat when its KV was computed (RoPE re-alignment shifts by the difference)."""
    tier: str
    checksum: str = ""
    """The checksum the directory registered for the block's copy in the remote tier ("" when it
    named none), which a copy read from there must carry (`offload.Hit.checksum`)."""

    @property
    def end(self) -> int:
        return self.start + self.tokens

    @property
    def shift(self) -> int:
        return self.start - self.source_position


class ContentIndex:
    """Content key -> (storage key, position it was computed at) of the blocks this node stored,
    the least recently used forgotten first beyond `entries`."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._stored: collections.OrderedDict[uuid.UUID, tuple[uuid.UUID, int]] = collections.OrderedDict()

    def __contains__(self, content_key: object) -> bool:
        return content_key in self._stored

    def __getitem__(self, content_key: uuid.UUID) -> tuple[uuid.UUID, int]:
        return self._stored[content_key]

    def __len__(self) -> int:
        return len(self._stored)

    def get(self, content_key: uuid.UUID) -> tuple[uuid.UUID, int] | None:
        """What `content_key` names, or None: one step, safe beside another thread's `remember`."""
        return self._stored.get(content_key)

    def touch(self, content_key: uuid.UUID) -> None:
        self._stored.move_to_end(content_key)

    def remember(self, content_key: uuid.UUID, stored: uuid.UUID, position: int) -> None:
        self._stored[content_key] = (stored, position)
        self._stored.move_to_end(content_key)
        while len(self._stored) > self.entries:
            self._stored.popitem(last=False)


log = logging.getLogger("strata.blend")


def directory_fragments(
    directory: Any,
    keys: dict[int, uuid.UUID],
    *,
    node: str,
    namespace: str,
    model_key: uuid.UUID,
    tiers: Collection[str],
    block_tokens: int,
    counters: Counters,
) -> dict[int, Fragment]:
    """The windows (offset -> content key) whose content the directory knows in a tier `node`
    reads (its own, or L3 with the checksum a copy read there must carry), in batches of
    MAX_BATCH. An outage of the directory means fewer fragments, counted in `lookup_failures`."""
    offsets, found = list(keys), {}
    try:
        for first in range(0, len(offsets), MAX_BATCH):
            chunk = offsets[first : first + MAX_BATCH]
            answer = directory.lookup(
                keys=[], node=node, namespace=namespace, model_key=model_key, content_keys=[keys[o] for o in chunk]
            )
            for offset, location in zip(chunk, answer.content, strict=True):
                if location is not None and location.tier in tiers and location.tokens == block_tokens:
                    found[offset] = Fragment(
                        start=offset,
                        tokens=block_tokens,
                        key=location.prefix_key,
                        source_position=location.position,
                        tier=location.tier,
                        checksum=location.remote_checksum,
                    )
    except Exception as exc:  # noqa: BLE001 - an outage of the directory means fewer fragments
        log.warning("fragment lookup failed, matching this node's own blocks only: %s", exc)
        counters.add("lookup_failures")
    return found


def content_keys_at(
    token_ids: Sequence[int], offsets: Iterable[int], *, ns_salt: bytes, model_key: uuid.UUID, block_tokens: int
) -> dict[int, uuid.UUID]:
    """The content key of the block-sized window at each offset: the same bytes as
    `hashing.content_key` of those tokens, computed from one encoding of the prompt."""
    encoded = encode_tokens(token_ids)
    model = model_key.bytes
    width = 4 * block_tokens
    keys = {}
    for offset in offsets:
        window = encoded[4 * offset : 4 * offset + width]
        if len(window) == width:
            keys[offset] = uuid.UUID(bytes=_content_key_raw(ns_salt, model, window))
    return keys


def fragment_key(*, ns_salt: bytes, model_key: uuid.UUID, content_key: uuid.UUID, position: int) -> uuid.UUID:
    """The storage key of a fragment block: a block kept for content reuse only (aligned to a
    segment, or computed after a blended part). Its own BLAKE2b personalisation keeps it apart
    from chained prefix keys, so a prefix lookup can never be served fused bytes."""
    h = hashlib.blake2b(digest_size=16, key=ns_salt, person=_PERSON_FRAGMENT)
    h.update(model_key.bytes)
    h.update(content_key.bytes)
    h.update(position.to_bytes(8, "little"))
    return uuid.UUID(bytes=h.digest())


def choose(candidates: dict[int, Fragment], *, start: int, end: int) -> list[Fragment]:
    """The non-overlapping candidates inside [start, end) that cover the most blocks; among
    equal covers the one with the faster tiers (a dynamic programme over offsets, O(n))."""
    if not candidates:
        return []
    # best[i]: (blocks, -tier cost) of the best choice within [i, end).
    size = end - start + 1
    best: list[tuple[int, int]] = [(0, 0)] * (size + 1)
    take: list[bool] = [False] * (size + 1)
    for i in range(end - 1, start - 1, -1):
        skip = best[i + 1 - start]
        chosen = skip
        fragment = candidates.get(i)
        if fragment is not None and fragment.end <= end:
            after = best[fragment.end - start]
            value = (after[0] + 1, after[1] - TIER_RANK.get(fragment.tier, 9))
            if value > skip:
                chosen = value
                take[i - start] = True
        best[i - start] = chosen
    picked = []
    i = start
    while i < end:
        if take[i - start]:
            fragment = candidates[i]
            picked.append(fragment)
            i = fragment.end
        else:
            i += 1
    return picked


def check_segments(segments: object, prompt_tokens: int) -> list[tuple[int, int]]:
    """A request's segment boundaries: [start, end) token offsets into the prompt, in order,
    not overlapping. Raises BlendError naming the bad entry."""
    if segments is None:
        return []
    if not isinstance(segments, list | tuple):
        raise BlendError("segments", f"must be a list of [start, end] token offsets, got {type(segments).__name__}")
    if len(segments) > prompt_tokens:
        raise BlendError("segments", f"{len(segments)} segments for a prompt of {prompt_tokens} tokens")
    result: list[tuple[int, int]] = []
    previous_end = 0
    for i, segment in enumerate(segments):
        field = f"segments[{i}]"
        if (
            not isinstance(segment, list | tuple)
            or len(segment) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in segment)
        ):
            raise BlendError(field, f"must be a pair of integers [start, end], got {segment!r}")
        begin, finish = segment
        if not 0 <= begin < finish <= prompt_tokens:
            raise BlendError(
                field,
                f"[{begin}, {finish}] must satisfy 0 <= start < end <= {prompt_tokens} (the prompt's length in tokens)",
            )
        if begin < previous_end:
            raise BlendError(
                field,
                f"starts at {begin}, inside the previous segment (which ends at {previous_end}); "
                "segments must be in order and must not overlap",
            )
        previous_end = finish
        result.append((begin, finish))
    return result


def segment_windows(segments: Sequence[tuple[int, int]], *, block_tokens: int, limit: int) -> list[int]:
    """Offsets of the whole blocks aligned to each segment's start (where a RAG client's
    passages begin), ending at or before `limit`."""
    offsets = []
    for begin, finish in segments:
        position = begin
        while position + block_tokens <= min(finish, limit):
            offsets.append(position)
            position += block_tokens
    return offsets


def gaps(chosen: Sequence[Fragment], *, start: int, end: int) -> list[tuple[int, int]]:
    """The [from, to) stretches of [start, end) that no chosen fragment covers."""
    found, position = [], start
    for fragment in chosen:
        if fragment.start > position:
            found.append((position, fragment.start))
        position = max(position, fragment.end)
    if position < end:
        found.append((position, end))
    return found
