"""Recounting the disk tier's ledger from its directory while the tier is in use: blocks removed
behind the tier's back and a dead writer's reservation come out of it, reported as drift; a live
process's file being unlinked stays counted until its bytes are freed."""

from __future__ import annotations

import os

from dataplane_support import SMALL, key, layout_of

LAYOUT = layout_of(SMALL, "bfloat16")  # 2 MiB blocks


def test_a_recount_corrects_the_ledger_to_the_directory(open_tier, block_cache) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4)
    for n in (1, 2, 3):
        tier.put(key(n), block_cache(LAYOUT, n))
    os.unlink(tier.path_of(key(1)))  # behind the tier's back
    # A writer on this host that died with a block reserved: its temporary file, its bytes pending.
    final = tier.path_of(key(9))
    final.parent.mkdir(exist_ok=True)
    dead = final.parent / f".{key(9).hex}.999999999.dead.{tier.file_bytes}.tmp"
    dead.write_bytes(b"partial")
    with tier._ledger.locked() as state:
        state[1] += tier.file_bytes
    assert tier.usage().blocks == 3 and tier.usage().used_bytes == 4 * tier.file_bytes

    recount = tier.recount()
    assert (recount.drift_bytes, recount.drift_blocks) == (2 * tier.file_bytes, 1)
    assert recount.usage == tier.usage()
    assert (recount.usage.blocks, recount.usage.stored_bytes, recount.usage.pending_bytes) == (
        2,
        2 * tier.file_bytes,
        0,
    )
    assert not dead.exists()
    assert not tier.recount().corrected  # the ledger holds the truth now


def test_a_recount_beside_a_delete_being_unlinked_keeps_its_bytes_until_freed(
    open_tier, block_cache, held_unlinks
) -> None:
    tier = open_tier("disk", LAYOUT, blocks=4, reuse_deleted_s=0)
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.delete(key(1))  # its unlink is held before the extents are freed
    recount = tier.recount()
    assert not recount.corrected
    assert recount.usage.pending_bytes == tier.file_bytes and recount.usage.blocks == 1
    held_unlinks.set()
    tier.drain_deletes()
    assert tier.usage().pending_bytes == 0
    assert not tier.recount().corrected
