"""Strata's tiers in vLLM's KV events, on real vLLM requests: a stored block is announced with vLLM's
own hashes of its pages (as vLLM's events name them), its parent page, its tokens and the tier's
medium; a dropped copy is announced removed once, from the tier it was announced in; what the
scheduler never planned is not announced; the events survive vLLM's msgpack as a KVEventBatch."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from worker.dataplane.connectors.vllm.kv_events import REMOVED, STORED, BlockEvents, TierChanges
from worker.dataplane.hashing import BlockFingerprint

BLOCK, PAGE = 64, 16


@pytest.fixture(scope="module", autouse=True)
def none_hash() -> None:
    init_none_hash(sha256)


def request(tokens: list[int], hash_tokens: int = PAGE, **fields) -> Request:
    return Request(
        request_id=f"r-{uuid.uuid4().hex[:6]}",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_tokens, sha256),
        **fields,
    )


def blocks(count: int) -> list[BlockFingerprint]:
    return [BlockFingerprint(i, i * BLOCK, uuid.uuid4(), uuid.uuid4()) for i in range(count)]


def hashes(req: Request, first: int, last: int) -> list:
    return [maybe_convert_block_hash(h) for h in req.block_hashes[first:last]]


def test_a_stored_block_is_named_by_vllm_s_page_hashes_and_its_tier():
    tokens = list(range(100, 100 + 3 * BLOCK + 10))
    req = request(tokens, cache_salt="salt", session_id="s-1")
    keys = blocks(3)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=PAGE)
    events.planned(req, keys[1:])  # block 0 was stored before
    events.reported([(STORED, "host", keys[1].prefix_key), (STORED, "remote", keys[1].prefix_key)])
    host, remote = events.take()
    assert events.take() == []
    assert isinstance(host, BlockStored) and isinstance(remote, BlockStored)
    assert host.block_hashes == hashes(req, 4, 8)  # block 1 is vLLM's pages 4..7
    assert host.parent_block_hash == maybe_convert_block_hash(req.block_hashes[3])
    assert host.token_ids == tokens[BLOCK : 2 * BLOCK] and host.block_size == PAGE
    assert (host.medium, host.locality, remote.medium, remote.locality) == (
        "strata-host",
        "LOCAL",
        "strata-remote",
        "REMOTE",
    )
    assert host.session_id == "s-1" and host.group_idx == 0 and host.lora_name is None
    assert host.extra_keys == [None] * (BLOCK // PAGE)  # the salt keys a request's first page only


def test_the_first_block_has_no_parent_and_carries_the_salt():
    req = request(list(range(1, 2 * BLOCK + 1)), cache_salt="salt")
    keys = blocks(2)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=PAGE)
    events.planned(req, keys)
    events.reported([(STORED, "disk", keys[0].prefix_key)])
    (stored,) = events.take()
    assert stored.parent_block_hash is None and stored.medium == "strata-disk"
    assert stored.extra_keys[0] == ("salt",) and stored.extra_keys[1:] == [None] * 3


def test_a_removed_copy_is_announced_once_from_the_tier_it_was_announced_in():
    req = request(list(range(1, 2 * BLOCK + 1)))
    keys = blocks(2)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=PAGE)
    events.planned(req, keys)
    events.reported(
        [
            (STORED, "host", keys[0].prefix_key),
            (REMOVED, "disk", keys[0].prefix_key),  # never announced there
            (REMOVED, "host", keys[0].prefix_key),
            (REMOVED, "host", keys[0].prefix_key),  # already gone
            (STORED, "host", uuid.uuid4()),  # never planned here: nothing names it
        ]
    )
    stored, removed = events.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored.block_hashes == hashes(req, 0, 4)
    assert (removed.medium, removed.locality) == ("strata-host", "LOCAL")


def test_pages_coarser_than_vllm_s_hashes_are_named_as_vllm_names_them():
    """vLLM hashes by 16 tokens and pages by 32: a page's hash is the last of its 16-token hashes."""
    req = request(list(range(1, BLOCK + 1)), hash_tokens=16)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=32)
    events.hash_block_tokens = 16
    keys = blocks(1)
    events.planned(req, keys)
    events.reported([(STORED, "host", keys[0].prefix_key)])
    (stored,) = events.take()
    assert stored.block_hashes == [maybe_convert_block_hash(req.block_hashes[i]) for i in (1, 3)]
    assert stored.block_size == 32


def test_the_oldest_payloads_are_forgotten_past_the_capacity():
    req = request(list(range(1, 3 * BLOCK + 1)))
    keys = blocks(3)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=PAGE, capacity=2)
    events.planned(req, keys)
    events.reported([(STORED, "host", key.prefix_key) for key in keys])
    assert [e.token_ids[0] for e in events.take()] == [1 + BLOCK, 1 + 2 * BLOCK]


def test_events_travel_in_vllm_s_batch_format():
    req = request(list(range(1, BLOCK + 1)))
    keys = blocks(1)
    events = BlockEvents(block_tokens=BLOCK, page_tokens=PAGE)
    events.planned(req, keys)
    events.reported([(STORED, "host", keys[0].prefix_key), (REMOVED, "host", keys[0].prefix_key)])
    sent = KVEventBatch(ts=1.0, events=events.take())
    received = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.Encoder().encode(sent))
    assert received.events == sent.events


def test_tier_changes_come_out_in_order_once():
    changes = TierChanges()
    first, second = uuid.uuid4(), uuid.uuid4()
    changes.stored("host", [first, second])
    changes.removed("host", first)
    assert changes.take() == [(STORED, "host", first), (STORED, "host", second), (REMOVED, "host", first)]
    assert changes.take() == []
