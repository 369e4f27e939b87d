"""Registration's write path: new blocks' copies go in without a conflict check, copies of blocks
that existed take the upsert, one batch may mix both; the block table carries only the indexes
its queries use."""

from __future__ import annotations

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.directory import queries
from controlplane.directory.models import Block, Placement
from controlplane.directory.services import blocks_register

pytestmark = pytest.mark.django_db

BLOCK_INDEXES = {"directory_block_pkey", "block_prefix_uniq", "block_content_hash", "block_ns_model_idx"}
"""Every index of directory_block and the queries that need it (see Block's docstring)."""


def _copies() -> set[tuple[str, str, str, int]]:
    return set(Placement.objects.values_list("block__prefix_key", "tier", "checksum", "epoch"))


def test_one_batch_mixes_new_blocks_existing_blocks_and_repeated_copies(registration, other_node):
    known = registration()
    blocks_register(registrations=[known])
    new = registration()
    counts = blocks_register(
        registrations=[
            known,  # the same copy again: nothing changes
            registration(prefix_key=known.prefix_key, tier="disk"),  # a second copy of a known block
            new,
            registration(prefix_key=new.prefix_key, checksum="1" * 32),  # the same copy named twice: the last wins
            registration(prefix_key=new.prefix_key, tier="host", node=other_node.name),  # another node's copy
            registration(prefix_key=new.prefix_key, tier="remote", node=None),
        ]
    )
    assert (counts.blocks, counts.placements) == (1, 4)
    assert Block.objects.count() == 2
    assert _copies() == {
        (known.prefix_key, "host", "0" * 32, 1),
        (known.prefix_key, "disk", "0" * 32, 1),
        (new.prefix_key, "host", "1" * 32, 1),
        (new.prefix_key, "host", "0" * 32, 1),
        (new.prefix_key, "remote", "0" * 32, 1),
    }
    assert set(
        Placement.objects.filter(block__prefix_key=new.prefix_key, tier="host").values_list("node__name", "checksum")
    ) == {("gpu-0", "1" * 32), ("gpu-1", "0" * 32)}


def test_a_changed_copy_of_a_known_block_moves_its_epoch(registration):
    reg = registration()
    blocks_register(registrations=[reg])
    counts = blocks_register(registrations=[registration(prefix_key=reg.prefix_key, checksum="2" * 32)])
    assert (counts.blocks, counts.placements) == (0, 1)
    assert _copies() == {(reg.prefix_key, "host", "2" * 32, 2)}


def test_new_copies_need_no_conflict_check_and_known_ones_probe_the_key_index(registration):
    """EXPLAIN of each statement of a registration: the new blocks' copies are a plain insert
    (no arbiter index, no per-row probe); the upsert of copies of known blocks probes the key."""
    regs = [registration(position=16 * i) for i in range(64)]
    now = timezone.now()
    with connection.cursor() as cursor:
        # A table this small is cheaper to scan than to probe; the plan at 10M is the index one.
        cursor.execute("SET LOCAL enable_seqscan = off")
        # Statistics as other tests' committed blocks left them can make the namespace-and-model
        # index look cheaper than the key's: plan on statistics of the rows there now.
        cursor.execute("ANALYZE directory_block")
        scope = queries.resolve(cursor, namespaces=["tenant-a"], model_keys=[regs[0].model_key], nodes=["gpu-0"])
        rows, _ = queries.registration_rows(scope, regs)
        params = queries.register_params(rows, now)
        blocks = queries.explain(cursor, queries.REGISTER_BLOCKS_SQL, params)
        ids = dict(Block.objects.values_list("prefix_key", "id"))
        new = queries.explain(
            cursor,
            queries.REGISTER_NEW_PLACEMENTS_SQL,
            {**params, "new_block_ids": queries.ints(ids[row.prefix_key] for row in rows)},
        )
        known = queries.explain(cursor, queries.REGISTER_PLACEMENTS_SQL, params)
    assert "Conflict Arbiter Indexes: block_prefix_uniq" in blocks and "Tuples Inserted: 64" in blocks
    assert "Conflict" not in new and "directory_block" not in new, new
    assert "Index Scan using block_prefix_uniq" in known and "Conflicting Tuples: 64" in known, known
    assert Placement.objects.count() == 64


def test_the_block_table_has_only_the_indexes_its_queries_use(db):
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'directory_block'")
        assert {name for (name,) in cursor.fetchall()} == BLOCK_INDEXES
