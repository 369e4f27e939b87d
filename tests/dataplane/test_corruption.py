"""A flipped byte, a truncated or swapped file or value is a miss: counted, quarantined, never served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.errors import BlockCorrupt, BlockMissing
from worker.dataplane.store import TieredStore

LAYOUT = layout_of(SMALL, "bfloat16")


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _expect_corrupt(tier, k, *, layers=None) -> None:
    if layers is None:
        out = LAYOUT.empty()
        with pytest.raises(BlockCorrupt):
            tier.get(k, out)
    else:
        [future] = tier.get_layers([k], layers, [LAYOUT.empty(layers=len(LAYOUT.layer_range(layers)))])
        with pytest.raises(BlockCorrupt):
            future.result(timeout=30)


# -- disk -------------------------------------------------------------------------------------
@pytest.fixture
def disk(open_tier, block_cache):
    tier = open_tier("disk", LAYOUT, blocks=4)
    for n in (1, 2):
        tier.put(key(n), block_cache(LAYOUT, n))
    return tier


@pytest.mark.parametrize("where", ["layer 5 data", "header checksums", "header fixed fields", "last byte"])
def test_disk_flipped_byte_is_corrupt_and_quarantined(disk, where: str) -> None:
    path = disk.path_of(key(1))
    offset = {
        "layer 5 data": disk.header_bytes + 5 * LAYOUT.layer_bytes + 123,
        "header checksums": 80 + 16 * 3,
        "header fixed fields": 20,
        "last byte": disk.header_bytes + LAYOUT.block_bytes - 1,
    }[where]
    _flip(path, offset)
    before = disk.usage()
    _expect_corrupt(disk, key(1))
    stats = disk.counters.snapshot()
    assert stats["disk.corrupt"] == 1 and stats["disk.quarantined"] == 1
    assert not path.exists()
    assert disk.usage().blocks == before.blocks - 1
    with pytest.raises(BlockMissing):
        disk.get(key(1), LAYOUT.empty())
    # The other block is untouched.
    out = LAYOUT.empty()
    disk.get(key(2), out)


def test_disk_layer_read_verifies_the_layer(disk, block_cache) -> None:
    _flip(disk.path_of(key(1)), disk.header_bytes + 5 * LAYOUT.layer_bytes + 7)
    # An intact layer of a damaged block is still served: its own checksum holds.
    out = LAYOUT.empty(layers=1)
    disk.get_layers([key(1)], 2, [out])[0].result(timeout=30)
    assert torch.equal(out, block_cache(LAYOUT, 1)[2 * LAYOUT.layer_bytes : 3 * LAYOUT.layer_bytes])
    _expect_corrupt(disk, key(1), layers=5)
    assert disk.counters.get("disk.corrupt") == 1


@pytest.mark.parametrize("keep", [1, 4096, 4096 + LAYOUT.block_bytes // 2, None])
def test_disk_truncated_file_is_corrupt(disk, keep) -> None:
    path = disk.path_of(key(1))
    size = path.stat().st_size
    os.truncate(path, size - 1 if keep is None else keep)
    _expect_corrupt(disk, key(1), layers=LAYOUT.layers - 1)
    assert disk.counters.get("disk.corrupt") == 1 and not path.exists()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "headers-cached"])
def test_disk_swapped_files_are_corrupt(disk, warm: bool) -> None:
    a, b = disk.path_of(key(1)), disk.path_of(key(2))
    if warm:  # the header cache must notice that the file under a name changed
        disk.get(key(1), LAYOUT.empty())
        disk.get(key(2), LAYOUT.empty())
    tmp = a.with_suffix(".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    _expect_corrupt(disk, key(1))
    _expect_corrupt(disk, key(2), layers=0)
    assert disk.counters.get("disk.corrupt") == 2


def test_disk_swapped_data_under_a_valid_header_is_corrupt(disk) -> None:
    # Copy block 2's bytes under block 1's (intact) header: layer checksums include the key.
    a, b = disk.path_of(key(1)), disk.path_of(key(2))
    data = b.read_bytes()[disk.header_bytes :]
    with open(a, "r+b") as f:
        f.seek(disk.header_bytes)
        f.write(data)
    _expect_corrupt(disk, key(1), layers=range(0, 2))


# -- host -------------------------------------------------------------------------------------
def test_host_flipped_byte_is_corrupt(open_tier, block_cache) -> None:
    tier = open_tier("host", LAYOUT, blocks=2)
    tier.put(key(1), block_cache(LAYOUT, 1))
    slot = tier._find(key(1))
    at = slot * tier.slot_bytes + 3 * LAYOUT.layer_bytes + 99
    tier._data[at] ^= 0x01
    _expect_corrupt(tier, key(1), layers=3)
    assert tier.counters.get("host.corrupt") == 1 and tier.counters.get("host.quarantined") == 1
    assert not tier.contains(key(1)) and tier.usage().blocks == 0


# -- remote -----------------------------------------------------------------------------------
@pytest.fixture
def remote(open_tier, block_cache):
    tier = open_tier("remote", LAYOUT, blocks=4)
    for n in (1, 2):
        tier.put(key(n), block_cache(LAYOUT, n))
    return tier


def test_remote_flipped_byte_is_corrupt(remote) -> None:
    name = remote.key_name(key(1))
    offset = remote.header_bytes + 4 * LAYOUT.layer_bytes + 5
    byte = remote.client.getrange(name, offset, offset)
    remote.client.setrange(name, offset, bytes([byte[0] ^ 0x80]))
    _expect_corrupt(remote, key(1), layers=4)
    assert remote.counters.get("remote.corrupt") == 1 and remote.counters.get("remote.quarantined") == 1
    assert not remote.contains(key(1))


@pytest.mark.parametrize("keep", [10, None])
def test_remote_truncated_value_is_corrupt(remote, keep) -> None:
    name = remote.key_name(key(1))
    value = remote.client.get(name)
    remote.client.set(name, value[:keep] if keep else value[:-1])
    _expect_corrupt(remote, key(1))
    remote.put(key(1), remote.layout.empty().zero_())  # rewrite, then truncate for a layer read
    remote.client.set(name, remote.client.get(name)[:-1])
    _expect_corrupt(remote, key(1), layers=LAYOUT.layers - 1)
    assert remote.counters.get("remote.corrupt") == 2


def test_remote_swapped_values_are_corrupt(remote) -> None:
    a, b = remote.key_name(key(1)), remote.key_name(key(2))
    client: redis.Redis = remote.client
    client.rename(a, b"swap")
    client.rename(b, a)
    client.rename(b"swap", b)
    _expect_corrupt(remote, key(1))
    _expect_corrupt(remote, key(2), layers=1)


# -- the store falls through to an intact copy -------------------------------------------------
def test_store_serves_the_next_tier_when_a_copy_is_corrupt(open_tier, block_cache, hasher) -> None:
    host = open_tier("host", LAYOUT, blocks=2, counters=None)
    disk = open_tier("disk", LAYOUT, blocks=2, counters=host.counters)
    store = TieredStore(layout=LAYOUT, tiers=[host, disk], counters=host.counters)
    block = block_cache(LAYOUT, 1)
    store.put(key(1), block, tier="host")
    store.put(key(1), block, tier="disk")
    host._data[host._find(key(1)) * host.slot_bytes + 17] ^= 0xFF
    result = store.get(key(1))
    assert result.tier == "disk" and torch.equal(result.data, block)
    stats = store.stats()
    assert stats["host.corrupt"] == 1 and stats["store.hits.disk"] == 1
    # Layer reads fall through the same way.
    _flip(disk.path_of(key(1)), disk.header_bytes + 11)
    store.put(key(1), block, tier="host")
    out = LAYOUT.empty(layers=1)
    [future] = store.get_layers([key(1)], layers=0, outs=[out])
    assert future.result(timeout=30).tier == "host"
    host._data[host._find(key(1)) * host.slot_bytes + 11] ^= 0xFF
    [future] = store.get_layers([key(1)], layers=0, outs=[out])
    with pytest.raises(BlockMissing) as missing:
        future.result(timeout=30)
    assert {type(c) for c in missing.value.causes} == {BlockCorrupt}
    assert store.stats()["store.misses"] == 1


@pytest.mark.parametrize("fused", [True, False], ids=["one-native-call", "block-by-block"])
def test_disk_layer_reads_of_many_blocks_fail_only_the_bad_ones(
    open_tier, block_cache, monkeypatch, fused: bool
) -> None:
    # Layer-wise loading reads one layer of many blocks at once; without the fused routine each
    # block is read and hashed on its own. Either way a missing, truncated or flipped block fails
    # its own future, is counted and quarantined, and every other block arrives exact.
    from worker.dataplane import native  # noqa: PLC0415

    calls = []
    if fused:
        real = native.ReadBatch.read
        monkeypatch.setattr(native.ReadBatch, "read", lambda batch: calls.append(len(batch._sizes)) or real(batch))
    else:
        monkeypatch.setattr(native, "available", lambda: False)
    tier = open_tier("disk", LAYOUT, blocks=8, io_threads=2)
    for n in range(1, 7):
        tier.put(key(n), block_cache(LAYOUT, n))
    tier.delete(key(2))
    os.truncate(tier.path_of(key(3)), tier.header_bytes + 3 * LAYOUT.layer_bytes)
    _flip(tier.path_of(key(5)), tier.header_bytes + 4 * LAYOUT.layer_bytes + 7)
    keys = [key(n) for n in range(1, 7)]
    outs = [LAYOUT.empty(layers=1) for _ in keys]
    futures = tier.get_layers(keys, 4, outs)
    outcome = {}
    for n, future in zip(range(1, 7), futures, strict=True):
        try:
            future.result(timeout=30)
            outcome[n] = "ok"
        except BlockMissing:
            outcome[n] = "missing"
        except BlockCorrupt:
            outcome[n] = "corrupt"
    assert outcome == {1: "ok", 2: "missing", 3: "corrupt", 4: "ok", 5: "corrupt", 6: "ok"}
    offset, nbytes = LAYOUT.span(4)
    for n in (1, 4, 6):
        assert torch.equal(outs[n - 1], block_cache(LAYOUT, n)[offset : offset + nbytes])
    assert tier.counters.get("disk.corrupt") == 2
    assert not tier.contains(key(3)) and not tier.contains(key(5))  # quarantined
    # One call per I/O thread's share (blocks 1, 3, 5 and 2, 4, 6), for the blocks that got that
    # far: 2 is missing and 3 too short to hold its layers, so each call reads two.
    assert calls == ([2, 2] if fused else [])


@pytest.mark.parametrize("layer", [0, 13, 30, 31])
def test_disk_whole_block_read_shared_by_two_threads_catches_a_flip_anywhere(
    open_tier, block_cache, layer: int
) -> None:
    # A large block is read by the caller and an I/O thread together, piece by piece; a flipped
    # byte in any piece (the first, a middle one, each thread's last one-layer piece) is caught.
    from dataplane_support import LLAMA  # noqa: PLC0415

    layout = layout_of(LLAMA, "bfloat16")
    tier = open_tier("disk", layout, blocks=2)
    tier.put(key(1), block_cache(layout, 1))
    out = layout.empty()
    tier.get(key(1), out)
    assert torch.equal(out, block_cache(layout, 1))
    _flip(tier.path_of(key(1)), tier.header_bytes + layer * layout.layer_bytes + 4095)
    with pytest.raises(BlockCorrupt, match=f"layer {layer} checksum mismatch"):
        tier.get(key(1), layout.empty())
    assert not tier.contains(key(1))
    assert tier.counters.get("disk.corrupt") == 1
