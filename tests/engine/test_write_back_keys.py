"""Write-back keys a prompt's blocks with the fingerprints its lookup computed: the same keys, and
no block of an already looked-up prefix hashed again. Only the blocks past the looked-up prompt
(the generated tokens' blocks) are hashed at write-back.

The hashing is counted at its root (`hashing._prefix_key_raw`, one call per block fingerprinted),
so any path that fingerprints a block again is seen."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from worker.dataplane import hashing
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter, KeyScope
from worker.dataplane.layout import ModelProfile, block_layout
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Chain
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.device import DeviceTier

PROFILE = ModelProfile(
    model_id="test/write-back-keys", layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=BLOCK_TOKENS
)
SCOPES = [
    None,
    KeyScope(adapter="lora-a:0123abcd"),
    KeyScope(salt="tenant-secret"),
    KeyScope(adapter="lora-a:0123abcd", salt="tenant-secret"),
]


class Hashes:
    """Counts the block fingerprints computed while `counting` is on."""

    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hashes]:
    counted = Hashes()
    real = hashing._prefix_key_raw

    def counting(salt: bytes, model: bytes, parent: bytes, tokens: bytes) -> bytes:
        counted.count += 1
        return real(salt, model, parent, tokens)

    monkeypatch.setattr(hashing, "_prefix_key_raw", counting)
    yield counted


@pytest.fixture
def manager() -> Iterator[OffloadManager]:
    layout = block_layout(PROFILE)
    store = TieredStore(layout=layout, tiers=[DeviceTier(layout=layout, capacity_bytes=8 * layout.block_bytes)])
    yield OffloadManager(store=store, profile=PROFILE, write_back_tier="device", decide=False)
    store.close()


def tokens_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(length)]


@pytest.mark.parametrize("scope", SCOPES, ids=["plain", "lora", "salt", "lora+salt"])
def test_write_back_keys_are_the_lookups_and_hash_nothing_again(manager, hashes, scope):
    prompt = tokens_of(5 * BLOCK_TOKENS + 7, seed=1)
    looked_up, _, chain = manager.find_prompt(prompt, "tenant", scope)
    assert len(looked_up) == 5

    before = hashes.count
    written = manager.fingerprints(prompt, "tenant", chain, scope, known=looked_up)
    assert hashes.count - before == 0
    assert written == looked_up

    # The generated tokens fill two more blocks: only those two are hashed, chained on from the
    # prompt's last block, and every key is the one a fresh fingerprinting computes.
    longer = prompt + tokens_of(2 * BLOCK_TOKENS - 7 + 3, seed=2)
    before = hashes.count
    extended = manager.fingerprints(longer, "tenant", chain, scope, known=looked_up)
    assert hashes.count - before == 2
    assert extended == manager.fingerprints(longer, "tenant", chain, scope)
    assert extended[:5] == looked_up
    assert [fp.index for fp in extended] == list(range(7))
    assert [fp.start for fp in extended] == [i * BLOCK_TOKENS for i in range(7)]


def test_other_namespace_salt_scope_or_model_keys_differently(manager):
    prompt = tokens_of(3 * BLOCK_TOKENS, seed=3)
    keys = {
        (namespace, scope): tuple(fp.prefix_key for fp in manager.find_prompt(prompt, namespace, scope)[0])
        for namespace in ("tenant", "other")
        for scope in SCOPES
    }
    assert len(set(keys.values())) == len(keys)
    other_model = Fingerprinter(ns_salt=b"tenant", model_key=uuid.uuid4(), block_tokens=BLOCK_TOKENS).blocks(prompt)
    assert [fp.prefix_key for fp in other_model] != list(keys[("tenant", None)])


def test_a_shared_lead_keeps_its_keys_and_the_own_blocks_chain_on(manager, hashes):
    prompt = tokens_of(6 * BLOCK_TOKENS, seed=4)
    shared = Fingerprinter(ns_salt=b"library", model_key=manager.model_key, block_tokens=BLOCK_TOKENS).blocks(prompt)
    chain = Chain(shared="library", lead=tuple(shared[:3]))
    looked_up = manager.fingerprints(prompt, "tenant", chain)
    assert looked_up[:3] == shared[:3] and looked_up[3:] != shared[3:]

    before = hashes.count
    assert manager.fingerprints(prompt, "tenant", chain, known=looked_up) == looked_up
    assert hashes.count - before == 0

    # A shared block that failed to load shortens the lead: the engine keeps the fingerprints of
    # the lead that is left, and the blocks after it are keyed as the request's own from there.
    cut = Chain(shared="library", lead=chain.lead[:1])
    before = hashes.count
    rekeyed = manager.fingerprints(prompt, "tenant", cut, known=looked_up[:1])
    assert hashes.count - before == 5
    assert rekeyed == manager.fingerprints(prompt, "tenant", cut)
    assert rekeyed[0] == shared[0] and rekeyed[1] != looked_up[1]


def test_engine_write_back_stores_under_the_looked_up_keys(models, make_store, hashes):
    """A request through the engine: its prompt's blocks are stored under exactly the keys its
    lookup computed, the write-back of the prompt hashes nothing, and the write-back after decoding
    hashes only the blocks the generated tokens completed."""
    model = models("tiny")
    engine = engine_for(model, make_store(model, ("host",)))
    looked_up: list[list[BlockFingerprint]] = []
    find_prompt = engine.offload.find_prompt

    def recording_lookup(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        found = find_prompt(*args, **kwargs)
        looked_up.append(found[0])
        return found

    engine.offload.find_prompt = recording_lookup  # type: ignore[method-assign]
    stored: list[uuid.UUID] = []
    store_block = engine.offload.store_block

    def recording_store(**kwargs):  # noqa: ANN003, ANN202
        stored.append(kwargs["key"])
        return store_block(**kwargs)

    engine.offload.store_block = recording_store  # type: ignore[method-assign]
    hashed_at_write_back: list[int] = []
    write_back = engine.writer.write_back

    def counting_write_back(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        before = hashes.count
        result = write_back(*args, **kwargs)
        hashed_at_write_back.append(hashes.count - before)
        return result

    engine.writer.write_back = counting_write_back  # type: ignore[method-assign]

    prompt = tokens_of(4 * BLOCK_TOKENS + 10, seed=5)
    result = engine.generate(prompt, max_tokens=BLOCK_TOKENS, namespace="tenant")
    assert len(looked_up) == 1 and len(looked_up[0]) == 4
    # The early write-back (the prompt) hashes nothing; the one after decoding hashes the one
    # block the generated tokens completed.
    full = (len(prompt) + len(result.output_ids) - 1) // BLOCK_TOKENS
    assert hashed_at_write_back == [0, full - 4]
    fresh = engine.offload.fingerprints(prompt + result.output_ids[:-1], "tenant")
    assert stored == [fp.prefix_key for fp in fresh]
    assert stored[:4] == [fp.prefix_key for fp in looked_up[0]]

    # The next turn finds every block under those keys.
    again = engine.generate(prompt + result.output_ids[:-1] + [7], max_tokens=1, namespace="tenant")
    assert again.trace.cached_tokens == full * BLOCK_TOKENS
