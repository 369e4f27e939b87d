"""The host pool is shared by processes: they see each other's blocks and never read torn bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dataplane_support import key, layout_of

from worker.dataplane.errors import BlockCorrupt, BlockMissing, TierFull

REPO = Path(__file__).resolve().parents[2]
LAYOUT = layout_of({"layers": 4, "kv_heads": 2, "head_dim": 64, "block_tokens": 128}, "float16")  # 128 KiB blocks


def pattern(n: int) -> torch.Tensor:
    """Bytes that differ at every position between blocks n and n+1..n+15 (blocks that can
    share the pool at one time), so a mix of two of them never passes for either."""
    base = torch.arange(LAYOUT.block_bytes, dtype=torch.int64)
    return ((base * 7 + (n % 16) * 13) % 251).to(torch.uint8)


def _run_child(body: str, pool: str) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import os, sys, time, uuid, torch
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from dataplane_support import key, layout_of
        from worker.dataplane.tiers.host import HostTier
        from test_host_shared import LAYOUT, pattern
        tier = HostTier(layout=LAYOUT, capacity_bytes=0, pool_name={pool!r})
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(child: subprocess.Popen, timeout: float = 120) -> str:
    out, err = child.communicate(timeout=timeout)
    assert child.returncode == 0, err
    return out


def test_a_second_process_sees_and_adds_blocks(open_tier, shm_name) -> None:
    tier = open_tier("host", LAYOUT, blocks=4)
    tier.put(key(1), pattern(1))
    child = _run_child(
        """
        out = LAYOUT.empty()
        tier.get(key(1), out)
        assert torch.equal(out, pattern(1))
        tier.put(key(2), pattern(2))
        tier.close()
        print("ok")
    """,
        shm_name,
    )
    assert _finish(child).strip() == "ok"
    out = LAYOUT.empty()
    tier.get(key(2), out)
    assert torch.equal(out, pattern(2))
    assert tier.usage().blocks == 2


def test_reader_racing_an_overwriting_evicting_writer_never_sees_torn_bytes(open_tier, shm_name) -> None:
    """The child cycles blocks through 4 slots (put, overwrite, delete) as fast as it can for a
    few seconds; this process reads recent keys meanwhile, whole and by layers. Every read is a
    miss or exactly the right bytes: never torn, never reported corrupt."""
    tier = open_tier("host", LAYOUT, blocks=4)  # an overwrite holds a second slot until it publishes
    child = _run_child(
        """
        patterns = [pattern(n) for n in range(16)]
        print("start", flush=True)
        i, deadline = 0, time.monotonic() + 3.0
        while time.monotonic() < deadline:
            tier.put(key(i), patterns[i % 16])
            if i % 5 == 0:
                tier.put(key(i), patterns[i % 16])   # overwrite: a new slot, then the old one is freed
            if i >= 2:
                tier.delete(key(i - 2))              # evict, so slots are reused for other blocks
            i += 1
        tier.close()
        print(i, flush=True)
    """,
        shm_name,
    )
    assert child.stdout.readline().strip() == "start"
    expected = {n: pattern(n) for n in range(16)}
    out = LAYOUT.empty()
    layer_out = LAYOUT.empty(layers=2)
    served = misses = 0
    candidates: list = []
    i = 0
    while child.poll() is None:
        i += 1
        if i % 8 == 0 or not candidates:
            candidates = tier.keys()
            if not candidates:
                continue
        k = candidates[i % len(candidates)]
        want = expected[(k.int - key(0).int) % 16]
        try:
            if i % 3:
                tier.get(k, out)
                assert torch.equal(out, want), f"torn read of {k}"
            else:
                tier.get_layers([k], range(1, 3), [layer_out])[0].result(timeout=30)
                assert torch.equal(layer_out, want[LAYOUT.layer_bytes : 3 * LAYOUT.layer_bytes]), f"torn layers of {k}"
            served += 1
        except BlockMissing:
            misses += 1
        except BlockCorrupt as exc:  # would mean the seqlock let a racing write through
            pytest.fail(f"a race was reported as corruption: {exc}")
    writes = int(_finish(child).strip())
    stats = tier.counters.snapshot()
    assert stats.get("host.corrupt", 0) == 0
    # The race must really have happened (on a loaded 2-core box the counts vary a lot), and the
    # writer rebuilt the key index under the reader's probes (4 slots: 16 buckets, rebuilt at 5
    # tombstones).
    assert writes >= 100 and served >= 20 and misses >= 1, (writes, served, misses, stats)
    assert int(tier._control[2]) >= 2


def test_slots_of_a_crashed_writer_are_reclaimed(open_tier, shm_name) -> None:
    tier = open_tier("host", LAYOUT, blocks=2)
    child = _run_child(
        """
        tier._allocate(key(7))   # take a slot as if writing, then die without publishing
        os._exit(0)
    """,
        shm_name,
    )
    child.wait(timeout=60)
    assert tier.usage().pending_bytes == LAYOUT.block_bytes
    tier.put(key(1), pattern(1))
    tier.put(key(2), pattern(2))  # needs the dead writer's slot
    assert tier.usage().blocks == 2 and tier.usage().pending_bytes == 0
    with pytest.raises(TierFull):
        tier.put(key(3), pattern(3))
    out = LAYOUT.empty()
    tier.get(key(2), out)
    assert torch.equal(out, pattern(2))


def test_full_pool_refuses_and_keeps_what_it_has(open_tier) -> None:
    tier = open_tier("host", LAYOUT, blocks=2)
    tier.put(key(1), pattern(1))
    tier.put(key(2), pattern(2))
    with pytest.raises(TierFull):
        tier.put(key(3), pattern(3))
    assert tier.counters.get("host.full") == 1
    assert not tier.contains(key(3))
    usage = tier.usage()
    assert usage.blocks == 2 and usage.pending_bytes == 0 and usage.free_bytes == 0
    tier.delete(key(1))
    tier.put(key(3), pattern(3))


def test_a_pool_of_another_layout_is_refused(open_tier, shm_name) -> None:
    open_tier("host", LAYOUT, blocks=2)
    other = layout_of({"layers": 4, "kv_heads": 2, "head_dim": 32, "block_tokens": 128}, "float16")
    with pytest.raises(ValueError, match="another layout"):
        open_tier("host", other, blocks=2)


def test_the_stored_checksum_is_read_from_the_slot_and_follows_an_overwrite(open_tier) -> None:
    tier = open_tier("host", LAYOUT, blocks=2)
    first = tier.put(key(1), pattern(1)).checksum
    assert tier.checksum(key(1)) == first
    assert tier.checksum(key(1)) == tier.get(key(1), LAYOUT.empty()).checksum
    second = tier.put(key(1), pattern(2)).checksum
    assert second != first and tier.checksum(key(1)) == second
    tier.delete(key(1))
    with pytest.raises(BlockMissing):
        tier.checksum(key(1))


def test_the_key_index_finds_every_block_through_churn(open_tier, shm_name) -> None:
    """Puts, overwrites and deletes of 48 keys through 12 slots, thousands of times, with a sweep
    that evicts everything now and then: the index (open addressing with tombstones, rebuilt
    when they pile up) always finds exactly the blocks stored, for this tier object and for a
    second mapping of the pool that caches nothing."""
    import random

    from worker.dataplane.tiers.host import INDEX_EMPTY, INDEX_GONE, READY, WRITING

    tier = open_tier("host", LAYOUT, blocks=12)
    other = open_tier("host", LAYOUT, blocks=12)  # the same pool, mapped again
    rng = random.Random(7)
    stored: dict[int, int] = {}  # key number -> pattern number
    for step in range(3000):
        n = rng.randrange(48)
        if step % 500 == 499:  # an eviction sweep: a burst of tombstones forces a rebuild
            for gone in list(stored):
                assert tier.delete(key(gone))
                del stored[gone]
        elif n in stored and rng.random() < 0.5:
            assert tier.delete(key(n))
            del stored[n]
        elif len(stored) < 11 or n in stored:  # an overwrite needs one free slot meanwhile
            p = rng.randrange(16)
            tier.put(key(n), pattern(p))
            stored[n] = p
        reader = other if step % 2 else tier
        assert reader.contains(key(n)) == (n in stored), (step, n)
    rebuilds = int(tier._control[2])
    assert rebuilds >= 2 and rebuilds % 2 == 0  # the tombstones were swept, more than once
    out = LAYOUT.empty()
    for n in range(48):
        for reader in (tier, other):
            if n in stored:
                reader.get(key(n), out)
                assert torch.equal(out, pattern(stored[n]))
            else:
                assert not reader.contains(key(n))
                with pytest.raises(BlockMissing):
                    reader.get(key(n), out)
    entries = [int(e) for e in tier._index if int(e) not in (INDEX_EMPTY, INDEX_GONE)]
    keyed = [s for s in range(tier.slots) if tier._state[s] in (READY, WRITING)]
    assert sorted(e - 1 for e in entries) == keyed and len(keyed) == len(stored)


def test_a_pool_of_an_older_layout_version_is_refused_with_the_remedy(open_tier, shm_name) -> None:
    import struct

    tier = open_tier("host", LAYOUT, blocks=2)
    tier.put(key(1), pattern(1))
    path = tier.path
    with open(path, "r+b") as pool:  # the version word follows the 8-byte magic
        pool.seek(8)
        pool.write(struct.pack("<I", 1))
    with pytest.raises(ValueError, match="has layout version 1, this release reads version 2") as info:
        open_tier("host", LAYOUT, blocks=2)
    assert "remove the file" in str(info.value) and str(path) in str(info.value)
    assert path.exists()  # refused, not replaced: the operator decides


def test_a_reader_that_meets_an_index_rebuild_scans_instead(open_tier) -> None:
    from worker.dataplane.tiers.host.key_index import key_words

    tier = open_tier("host", LAYOUT, blocks=4)
    tier.put(key(1), pattern(1))
    other = open_tier("host", LAYOUT, blocks=4)  # no cached slot numbers
    tier._control[2] += 1  # as another process does while it rebuilds the index
    try:
        assert other._index_slots(*key_words(key(1))) is None
        assert other.contains(key(1)) and not other.contains(key(2))
        out = LAYOUT.empty()
        other.get(key(1), out)
        assert torch.equal(out, pattern(1))
    finally:
        tier._control[2] += 1


def test_the_key_index_spreads_keys_that_differ_in_a_few_bytes() -> None:
    # Sequential ids differ only in their last bytes, which land in the high bits of a key word:
    # a weak hash put them all in one bucket, and every probe walked the whole cluster.
    import uuid

    from worker.dataplane.tiers.host.key_index import bucket_of, key_words
    from worker.dataplane.tiers.host.pool_layout import index_buckets

    buckets = index_buckets(512)
    for keys in (
        [uuid.UUID(int=n + 1) for n in range(512)],
        [key(n) for n in range(512)],
        [uuid.UUID(int=n << 120) for n in range(1, 256)] + [uuid.UUID(int=n << 56) for n in range(1, 256)],
    ):
        used = {bucket_of(*key_words(k), buckets - 1) for k in keys}
        assert len(used) > 0.7 * len(keys), len(used)  # ~79% for uniform hashing at this load


def test_a_key_index_left_half_built_by_a_dead_process_is_rebuilt_on_open(open_tier) -> None:
    from worker.dataplane.tiers.host.key_index import key_words

    tier = open_tier("host", LAYOUT, blocks=4)
    tier.put(key(1), pattern(1))
    tier.put(key(2), pattern(2))
    # As a process killed inside a rebuild leaves it: counter odd, table emptied.
    tier._control[2] = int(tier._control[2]) | 1
    tier._index[:] = 0
    assert tier.contains(key(1))  # meanwhile readers still find blocks (cache, or a scan)
    other = open_tier("host", LAYOUT, blocks=4)
    assert int(other._control[2]) % 2 == 0
    assert other._index_slots(*key_words(key(2))) is not None
    out = LAYOUT.empty()
    other.get(key(2), out)
    assert torch.equal(out, pattern(2))
    other.delete(key(1))
    assert not tier.contains(key(1)) and tier.contains(key(2))


def test_a_pool_larger_than_its_shared_memory_is_refused_naming_both_sizes(tmp_path, shm_name) -> None:
    import os

    from worker.dataplane.tiers.host import HostTier

    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    asked = free + 2**30
    with pytest.raises(ValueError, match=f"does not fit in {tmp_path}") as info:
        HostTier(layout=LAYOUT, capacity_bytes=asked, pool_name=shm_name, shm_dir=tmp_path)
    message = str(info.value)
    assert f"for host_bytes {asked / 2**30:.2f} GiB" in message, message
    assert f"has {free / 2**30:.2f} GiB" in message or "GiB free of" in message, message
    assert "shm_size" in message and "sizeLimit" in message
    assert all(p.stat().st_size == 0 for p in tmp_path.iterdir())  # refused before allocating a byte


def test_a_recount_reclaims_a_dead_writers_slot_now_and_keeps_a_live_ones(open_tier, shm_name) -> None:
    tier = open_tier("host", LAYOUT, blocks=4)
    tier.put(key(1), pattern(1))
    child = _run_child(
        """
        tier._allocate(key(7))   # take a slot as if writing, then die without publishing
        os._exit(0)
    """,
        shm_name,
    )
    child.wait(timeout=60)
    live = tier._allocate(key(8))  # this process, still writing
    assert tier.usage().pending_bytes == 2 * LAYOUT.block_bytes
    recount = tier.recount()
    assert (recount.drift_bytes, recount.drift_blocks) == (LAYOUT.block_bytes, 0)
    assert recount.usage == tier.usage()
    assert recount.usage.pending_bytes == LAYOUT.block_bytes and recount.usage.blocks == 1
    assert tier.recount().drift_bytes == 0  # nothing left to reclaim; the live slot is kept
    with tier._locked():
        tier._release(live)
