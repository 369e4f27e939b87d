"""A copy in the remote tier is served only when its checksum is the one registered for its key.

Every node can write to L3, so a value rewritten there with other bytes and a header that is
right for them passes the tier's own checks. With the registered checksum at hand (`expected`,
`Hit.checksum`), the store refuses it as a miss and counts it, and the quarantine drops it; the
genuine value loads. Both remote mediums: Redis and a shared filesystem served by the disk tier.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import MISSES, BlockMissing, BlockUnregistered
from worker.dataplane.layer_loader.loader import LayerLoader, PrefixBuffers
from worker.dataplane.offload_records import Hit
from worker.dataplane.prefix.cache import LoadFailed
from worker.dataplane.store import TieredStore

LAYOUT = layout_of(SMALL, "bfloat16")


@pytest.fixture(params=["redis", "shared-fs"])
def tiers(request, open_tier, tmp_path):
    """A host tier and a remote tier (Redis, or a shared mount through the disk tier), one store."""
    host = open_tier("host", LAYOUT, blocks=2)
    if request.param == "redis":
        remote = open_tier("remote", LAYOUT, blocks=4, counters=host.counters)
    else:
        remote = open_tier(
            "disk", LAYOUT, blocks=4, counters=host.counters, path=tmp_path / "mount" / "strata", name="remote"
        )
    store = TieredStore(layout=LAYOUT, tiers=[host, remote], counters=host.counters)
    return store, remote


def forge(remote, block_key: uuid.UUID, block: torch.Tensor) -> str:
    """What any node holding the remote tier's address can do: write other bytes under a key, with
    a header that is right for them. Returns the forged value's checksum."""
    forged = block.clone()
    forged[: LAYOUT.layer_bytes] = forged[: LAYOUT.layer_bytes].flip(0)
    result = remote.put(block_key, forged)
    assert remote.checksum(block_key) == result.checksum  # a self-consistent value
    return result.checksum.hex


def read(store: TieredStore, keys, *, layers=0, expected=None) -> tuple[list[Exception | None], list[torch.Tensor]]:
    selected = LAYOUT.layer_range(layers)
    outs = [LAYOUT.empty(layers=len(selected)) for _ in keys]
    futures = store.get_layers(keys, layers=selected, outs=outs, expected=expected)
    return [future.exception(timeout=30) for future in futures], outs


@pytest.mark.parametrize("layers", [0, 3, slice(None)])
def test_a_forged_remote_copy_is_a_counted_miss(tiers, block_cache, layers):
    store, remote = tiers
    block = block_cache(LAYOUT, 1)
    registered = remote.put(key(1), block).checksum.hex
    stored = forge(remote, key(1), block)
    assert stored != registered

    for reads in (1, 2):  # refused for as long as it is there, never served
        [error], _ = read(store, [key(1)], layers=layers, expected=[registered])
        assert isinstance(error, BlockMissing) and isinstance(error, MISSES)
        [cause] = error.causes
        assert isinstance(cause, BlockUnregistered) and cause.tier == "remote"
        assert (cause.key, cause.stored, cause.registered) == (key(1), stored, registered)
        assert str(key(1)) in str(cause) and stored in str(cause) and registered in str(cause)
        assert store.stats()["remote.unverified"] == reads
    assert "remote.corrupt" not in store.stats()  # the bytes are what their header says: not damage

    # The quarantine of the failed load drops the copy it refused...
    assert store.drop_unregistered(cause)
    assert not remote.contains(key(1)) and store.stats()["remote.quarantined"] == 1
    # ...and only that one: a copy written over it since is left to its own readers.
    remote.put(key(1), block)
    assert not store.drop_unregistered(cause) and remote.contains(key(1))


def test_the_genuine_copy_loads_every_layer_exactly(tiers, block_cache):
    store, remote = tiers
    block = block_cache(LAYOUT, 2)
    registered = remote.put(key(2), block).checksum.hex
    for layers in (0, 5, slice(None)):
        [error], [out] = read(store, [key(2)], layers=layers, expected=[registered])
        assert error is None
        selected = LAYOUT.layer_range(layers)
        start = selected.start * LAYOUT.layer_bytes
        assert torch.equal(out, block[start : start + len(selected) * LAYOUT.layer_bytes])
    assert "remote.unverified" not in store.stats()


def test_nothing_registered_keeps_the_remote_tier_out(tiers, block_cache):
    """An empty expected checksum (a hit in the node's own tiers) never falls through to L3: no
    registration vouches for what L3 holds. No expected checksums at all (no directory) reads L3
    as before, checked against the value's own header only."""
    store, remote = tiers
    block = block_cache(LAYOUT, 3)
    forged = forge(remote, key(3), block)
    [error], _ = read(store, [key(3)], expected=[""])
    assert isinstance(error, BlockMissing) and error.causes == ()
    assert remote.contains(key(3)) and "remote.unverified" not in store.stats()
    [error], _ = read(store, [key(3)])
    assert error is None and remote.checksum(key(3)).hex == forged


def test_local_copies_are_served_whatever_the_remote_checksum(tiers, block_cache):
    store, remote = tiers
    block = block_cache(LAYOUT, 4)
    store.put(key(4), block, tier="host")
    forge(remote, key(4), block)
    [error], [out] = read(store, [key(4)], layers=slice(None), expected=[""])
    assert error is None and torch.equal(out, block)


def test_read_layers_checks_a_remote_tier_that_holds_every_block(tiers, block_cache):
    """With the remote tier alone, a shared mount is the fastest holder of every block: read
    through the checked path, not the one-call gather."""
    _, remote = tiers
    store = TieredStore(layout=LAYOUT, tiers=[remote], counters=remote.counters)
    good, bad = block_cache(LAYOUT, 5), block_cache(LAYOUT, 6)
    registered = [remote.put(key(5), good).checksum.hex, remote.put(key(6), bad).checksum.hex]
    forge(remote, key(6), bad)
    out = torch.empty(2 * LAYOUT.layer_bytes, dtype=torch.uint8)
    errors = store.read_layers([key(5), key(6)], layers=0, out=out, expected=registered)
    assert errors[0] is None and torch.equal(out[: LAYOUT.layer_bytes], good[: LAYOUT.layer_bytes])
    assert isinstance(errors[1], BlockMissing)
    assert any(isinstance(cause, BlockUnregistered) for cause in errors[1].causes)


def test_the_loader_fails_the_forged_block_and_loads_the_genuine_one(tiers, block_cache):
    store, remote = tiers
    blocks = [block_cache(LAYOUT, 7), block_cache(LAYOUT, 8)]
    sums = [remote.put(key(7 + i), block).checksum.hex for i, block in enumerate(blocks)]
    hits = [Hit(i, key(7 + i), "remote", checksum=sums[i]) for i in range(2)]

    def load(hits: list[Hit]) -> tuple[LayerLoader, PrefixBuffers]:
        buffers = PrefixBuffers(layout=LAYOUT, blocks=len(hits), device=torch.device("cpu"))
        loader = LayerLoader(store=store, hits=hits, buffers=buffers, verify_remote=True).start()
        loader.join()
        return loader, buffers

    loader, buffers = load(hits)
    loader.wait_all()
    for layer in range(LAYOUT.layers):
        for j, block in enumerate(blocks):
            assert torch.equal(
                buffers.slot(layer, j), block[layer * LAYOUT.layer_bytes : (layer + 1) * LAYOUT.layer_bytes]
            )

    forge(remote, key(8), blocks[1])
    loader, _ = load(hits)
    with pytest.raises(LoadFailed) as failed:
        loader.gates[0].wait()
    assert failed.value.block_index == 1  # the request recomputes from the forged block on
    # Every layer's read of it fails the same way (the copy stays until quarantined), so the
    # failure the loader reports names it whichever read came first.
    [cause] = failed.value.cause.causes
    assert isinstance(cause, BlockUnregistered) and cause.key == key(8)
    assert store.stats()["remote.unverified"] >= 1
    loader, buffers = load(hits[:1])  # the block before it still loads
    loader.wait_all()
    assert torch.equal(buffers.slot(0, 0), blocks[0][: LAYOUT.layer_bytes])


def test_a_malformed_expected_checksum_is_refused_by_name():
    block_key = uuid.UUID(int=7)
    for bad in ("XYZ", "ABCDEF0123456789ABCDEF0123456789", "0" * 31, None):
        with pytest.raises(
            ValueError, match=rf"checksum of hit 2 \(block {block_key}\): expected 32 lower-case hex"
        ) as refused:
            Hit(2, block_key, "remote", checksum=bad)  # type: ignore[arg-type]
        assert repr(bad) in str(refused.value)
    assert Hit(2, block_key, "remote", checksum="0" * 32).checksum == "0" * 32


def test_a_malformed_expected_checksum_in_a_read_is_an_error_not_a_miss(tiers, block_cache):
    store, remote = tiers
    remote.put(key(9), block_cache(LAYOUT, 9))
    [error], _ = read(store, [key(9)], expected=["not-a-checksum"])
    assert isinstance(error, ValueError) and not isinstance(error, MISSES)
    assert "expected checksum of block" in str(error) and "'not-a-checksum'" in str(error)
    assert "remote.unverified" not in store.stats()
    with pytest.raises(ValueError, match="1 keys but 2 expected checksums"):
        store.get_layers([key(9)], layers=0, outs=[LAYOUT.empty(layers=1)], expected=["", ""])
