"""The planner's and the ledger's queries are index scans: EXPLAIN on a directory of 60,000 blocks
over 8 nodes shows no sequential scan of the block, placement or movement tables."""

from __future__ import annotations

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.directory.models import Node
from controlplane.movements.planner import candidates_params, candidates_sql
from controlplane.movements.selectors import _WARM_SQL, movements_list
from controlplane.policies.snapshot import TierPolicySpec
from tests.movements.conftest import node_report, snapshot

pytestmark = pytest.mark.django_db

BLOCKS = 60_000
NODES = 8


@pytest.fixture
def big_directory(profile, namespaces):  # type: ignore[no-untyped-def]
    nodes = [
        node_report(f"gpu-{i}", host=(1 << 30, 1 << 30), disk=(1 << 32, 0), remote=(1 << 34, 0)).id
        for i in range(NODES)
    ]
    ns = namespaces["tenant-a"].id
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO directory_block (namespace_id, model_id, prefix_key, content_key, position, token_count, "
            "size_bytes, priority, created_at, last_access_at, access_count) "
            "SELECT %s, %s, gen_random_uuid(), gen_random_uuid(), 0, 16, 4096, 'default', now(), "
            "now() - make_interval(secs => g), g %% 7 FROM generate_series(1, %s) g",
            [ns, profile.id, BLOCKS],
        )
        cursor.execute(
            'INSERT INTO directory_placement (block_id, tier, node_id, locator, "offset", size_bytes, checksum, state, '
            "epoch, updated_at) SELECT b.id, (ARRAY['host','disk','remote'])[b.id %% 3 + 1], "
            "CASE WHEN b.id %% 3 = 2 THEN NULL ELSE (%s::bigint[])[(b.id / 3) %% %s + 1] END, '', 0, 4096, '', "
            "'ready', 1, now() FROM directory_block b",
            ["{" + ",".join(map(str, nodes)) + "}", NODES],
        )
        cursor.execute(
            "INSERT INTO movements_movement (plan, block_id, kind, reason, state, src_placement_id, "
            "src_epoch, src_tier, src_node, dst_tier, dst_node, exec_node, attempts, policy_version, mode, "
            "bytes, detail, error, created_at) SELECT gen_random_uuid(), b.id, 'move', 'schedule', 'done', "
            "0, 1, 'host', 'gpu-0', 'disk', 'gpu-0', 'gpu-0', 1, 1, '', 4096, '', '', now() "
            "FROM directory_block b"
        )
        cursor.execute("ANALYZE directory_block; ANALYZE directory_placement; ANALYZE movements_movement")
    return nodes


def explain(sql: str, params: object) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def assert_index_only(plan_text: str) -> None:
    for table in ("directory_block", "directory_placement", "movements_movement"):
        assert f"Seq Scan on {table}" not in plan_text, plan_text
    assert "Index" in plan_text, plan_text


@pytest.mark.parametrize("algorithm", ["lru", "lfu", "s3fifo", "cost-aware"])
@pytest.mark.parametrize("tier", ["host", "remote"])
def test_victim_query_is_an_index_range_scan(big_directory, algorithm, tier):
    spec = TierPolicySpec(tier=tier, algorithm=algorithm, ttl_seconds=3600, min_accesses=2)
    node_id = None if tier == "remote" else Node.objects.get(name="gpu-3").id
    params = candidates_params(
        snapshot=snapshot(spec),
        spec=spec,
        node_id=node_id,
        tier=tier,
        needed=1 << 20,
        now=timezone.now(),
        namespaces={1: "tenant-a"},
    )
    text = explain(candidates_sql(algorithm=algorithm, remote=tier == "remote"), params)
    assert_index_only(text)
    assert "placement_node_tier_idx" in text, text


def test_warm_query_of_named_blocks_is_an_index_scan(big_directory):
    # Warming "the most used remote blocks" reads the whole remote tier (its size, not the
    # directory's); warming named blocks, what a scheduled job does, probes them one by one.
    text = explain(
        _WARM_SQL,
        {
            "node_id": big_directory[0],
            "any_block": False,
            "block_ids": "{5,8,11,14}",
            "namespace_id": None,
            "limit": 256,
        },
    )
    assert_index_only(text)


@pytest.mark.parametrize(
    "filters",
    [
        {"state": "running"},
        {"block": 5},
        {"node": "gpu-1"},
        {"src_tier": "host", "dst_tier": "disk"},
        {"reason": "ttl"},
        {"kind": "evict"},
    ],
)
def test_ledger_filters_are_index_scans(big_directory, filters):
    query = movements_list(**filters).order_by("-id")[:100]
    sql, params = query.query.sql_with_params()
    assert_index_only(explain(sql, params))
