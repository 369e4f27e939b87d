"""The planner on the real PostgreSQL: each algorithm's victim order, watermarks, TTL,
min_accesses, priority weights, demotion targets, and one in-flight movement per block."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from controlplane.directory.models import Placement
from controlplane.movements.choices import MovementKind, MovementReason, MovementState
from controlplane.movements.errors import MovementError
from controlplane.movements.models import Movement
from controlplane.movements.services import movements_plan, movements_warm
from controlplane.policies.snapshot import PriorityClassSpec, TierPolicySpec
from tests.movements.conftest import BLOCK_BYTES, node_report, snapshot

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db


def host_policy(**fields: object) -> TierPolicySpec:
    values: dict[str, object] = {"tier": "host", "high_watermark": 0.9, "low_watermark": 0.5}
    values.update(fields)
    return TierPolicySpec(**values)  # type: ignore[arg-type]


def victims(result) -> list[int]:  # type: ignore[no-untyped-def]
    return [m.block_id for m in result.movements]


@pytest.fixture
def full_node(db):  # type: ignore[no-untyped-def]
    """gpu-0: host 10 blocks, all used (over a 90% watermark); an empty disk below it."""
    return node_report("gpu-0", host=(10 * B, 10 * B), disk=(100 * B, 0))


def test_lru_picks_least_recently_used_until_the_low_watermark(full_node, make_blocks):
    blocks = make_blocks(10, ages=[50, 10, 90, 30, 70, 20, 80, 40, 60, 0])
    result = movements_plan(snapshot=snapshot(host_policy(algorithm="lru")), dry_run=True)
    # used 10 B, low watermark 5 B: the five idlest blocks leave, idlest first.
    assert victims(result) == [blocks[i].id for i in (2, 6, 4, 8, 0)]
    assert {(m.kind, m.route, m.reason) for m in result.movements} == {("move", "host->disk", "schedule")}
    summary = result.summary()
    assert summary["moves"] == 5 and summary["evictions"] == 0
    assert summary["bytes_moved"] == 5 * B
    assert summary["by_route"] == {"host->disk": {"blocks": 5, "bytes": 5 * B}}
    assert Movement.objects.count() == 0  # a dry run writes nothing


def test_lfu_picks_the_fewest_accesses(full_node, make_blocks):
    blocks = make_blocks(10, accesses=[5, 1, 9, 0, 7, 3, 8, 2, 6, 4], ages=[0] * 10)
    result = movements_plan(snapshot=snapshot(host_policy(algorithm="lfu")), dry_run=True)
    assert victims(result) == [blocks[i].id for i in (3, 1, 7, 5, 9)]


def test_s3fifo_evicts_blocks_seen_once_first_in_arrival_order_then_lru(full_node, make_blocks):
    # Blocks 0-2 were never used again (access count 0): they leave first, oldest arrival first,
    # even though they were written more recently than the reused ones were last used.
    blocks = make_blocks(
        10,
        accesses=[0, 0, 0, 3, 3, 3, 3, 3, 3, 3],
        created=[100, 300, 200, 900, 900, 900, 900, 900, 900, 900],
        ages=[1, 1, 1, 500, 100, 700, 300, 50, 20, 10],
    )
    result = movements_plan(snapshot=snapshot(host_policy(algorithm="s3fifo")), dry_run=True)
    assert victims(result) == [blocks[i].id for i in (1, 2, 0, 5, 3)]


def test_cost_aware_keeps_what_is_costly_to_recompute_and_likely_reused(full_node, make_blocks):
    # Same size everywhere: value = reuse likelihood x recompute cost. Deep positions cost more
    # to recompute; many recent accesses make reuse likely.
    blocks = make_blocks(
        10,
        accesses=[0, 0, 50, 50, 0, 0, 50, 50, 10, 10],
        positions=[0, 16384, 0, 16384, 0, 16384, 0, 16384, 0, 16384],
        ages=[3600, 3600, 3600, 3600, 60, 60, 60, 60, 600, 600],
    )
    result = movements_plan(snapshot=snapshot(host_policy(algorithm="cost-aware")), dry_run=True)
    # Lowest value first: never reused and shallow (0, then 4), then never reused and deep (1, 5),
    # then the shallow block with a few old accesses (8).
    assert victims(result) == [blocks[i].id for i in (0, 4, 1, 5, 8)]


def test_below_the_high_watermark_nothing_moves(db, make_blocks):
    node_report("gpu-0", host=(10 * B, 9 * B), disk=(100 * B, 0))
    make_blocks(9, ages=list(range(9)))
    result = movements_plan(snapshot=snapshot(host_policy()), dry_run=True)
    assert result.movements == []
    assert result.summary()["tiers"][0]["over_high_watermark"] is False


def test_policy_capacity_caps_the_reported_one(db, make_blocks):
    # The node reports 100 blocks of room and uses 8: fine by itself, but the policy allows 8
    # blocks of host, so it is over 90% of that and goes down to 50% (4 blocks).
    node_report("gpu-0", host=(100 * B, 8 * B), disk=(100 * B, 0))
    make_blocks(8, ages=list(range(8)))
    result = movements_plan(snapshot=snapshot(host_policy(capacity_bytes=8 * B)), dry_run=True)
    assert len(result.movements) == 4
    bigger = movements_plan(snapshot=snapshot(host_policy(capacity_bytes=80 * B)), dry_run=True)
    assert bigger.movements == []


def test_ttl_demotes_idle_blocks_below_the_watermark_and_min_accesses_evicts_expired_unused_ones(db, make_blocks):
    node_report("gpu-0", host=(100 * B, 6 * B), disk=(100 * B, 0))
    blocks = make_blocks(6, ages=[10, 7200, 7200, 30, 9000, 5], accesses=[0, 5, 0, 0, 1, 0])
    result = movements_plan(snapshot=snapshot(host_policy(ttl_seconds=3600, min_accesses=2)), dry_run=True)
    by_block = {m.block_id: m for m in result.movements}
    assert set(by_block) == {blocks[1].id, blocks[2].id, blocks[4].id}
    assert {m.reason for m in result.movements} == {MovementReason.TTL}
    assert by_block[blocks[1].id].kind == MovementKind.MOVE  # reused enough: demoted to disk
    assert by_block[blocks[1].id].dst_tier == "disk"
    assert by_block[blocks[2].id].kind == MovementKind.EVICT  # expired and used fewer than twice
    assert by_block[blocks[4].id].kind == MovementKind.EVICT


def test_min_accesses_sets_rarely_used_blocks_apart_first(full_node, make_blocks):
    blocks = make_blocks(10, accesses=[9, 9, 9, 0, 9, 1, 9, 9, 9, 9], ages=[90, 80, 70, 1, 60, 2, 50, 40, 30, 20])
    result = movements_plan(snapshot=snapshot(host_policy(min_accesses=2)), dry_run=True)
    assert victims(result)[:2] == [blocks[5].id, blocks[3].id]  # below min_accesses: LRU among them
    assert victims(result)[2:] == [blocks[0].id, blocks[1].id, blocks[2].id]


def test_lower_priority_weight_goes_first(full_node, make_blocks):
    recent_batch = make_blocks(3, namespace="batch", ages=[1, 2, 3])
    old_realtime = make_blocks(7, namespace="realtime", ages=[100, 200, 300, 400, 500, 600, 700])
    classes = (
        PriorityClassSpec(name="bulk", weight=0.1, namespaces=("batch",)),
        PriorityClassSpec(name="interactive", weight=10.0, namespaces=("realtime",)),
    )
    result = movements_plan(snapshot=snapshot(host_policy(), classes=classes), dry_run=True)
    assert victims(result) == [
        recent_batch[2].id,
        recent_batch[1].id,
        recent_batch[0].id,
        old_realtime[6].id,
        old_realtime[5].id,
    ]
    # A block's own priority names its class, whatever its namespace.
    flagged = make_blocks(1, namespace="realtime", ages=[0], priority="bulk")
    node_report("gpu-0", host=(10 * B, 11 * B), disk=(100 * B, 0))
    result = movements_plan(snapshot=snapshot(host_policy(), classes=classes), dry_run=True)
    # It is in the light class now: it leaves right after the older light blocks, before any heavy one.
    assert victims(result)[:4] == [recent_batch[2].id, recent_batch[1].id, recent_batch[0].id, flagged[0].id]


def test_demotion_goes_host_disk_remote_and_evicts_at_the_bottom(db, make_blocks):
    node_report("gpu-0", host=(10 * B, 10 * B), disk=(10 * B, 10 * B), remote=(10 * B, 10 * B))
    node_report("gpu-1", host=(10 * B, 0), remote=(10 * B, 10 * B))
    host = make_blocks(10, ages=list(range(10)))
    disk = make_blocks(10, tier="disk", ages=list(range(10)))
    remote = make_blocks(10, tier="remote", node=None, ages=list(range(10)))
    result = movements_plan(
        snapshot=snapshot(
            host_policy(),
            TierPolicySpec(tier="disk", high_watermark=0.9, low_watermark=0.5),
            TierPolicySpec(tier="remote", high_watermark=0.9, low_watermark=0.5),
        ),
        dry_run=True,
    )
    routes = {m.block_id: (m.route, m.exec_node) for m in result.movements}
    assert sum(1 for b in remote if b.id in routes) == 5
    assert {routes[b.id][0] for b in remote if b.id in routes} == {"remote->evicted"}
    # Remote evictions are shared out among the nodes that have the remote tier.
    assert {routes[b.id][1] for b in remote if b.id in routes} == {"gpu-0", "gpu-1"}
    # Lowest tier first: the remote tier drops to 5 blocks, so it has room for 4 below its 90%
    # watermark; the disk sends its 4 idlest there and evicts the fifth. The host likewise.
    assert [routes[b.id] for b in reversed(disk) if b.id in routes] == [("disk->remote", "gpu-0")] * 4 + [
        ("disk->evicted", "gpu-0")
    ]
    assert [routes[b.id] for b in reversed(host) if b.id in routes] == [("host->disk", "gpu-0")] * 4 + [
        ("host->evicted", "gpu-0")
    ]
    assert result.summary()["evictions"] == 7


def test_a_policy_demote_tier_skips_disk(full_node, make_blocks):
    node_report("gpu-0", host=(10 * B, 10 * B), disk=(100 * B, 0), remote=(100 * B, 0))
    make_blocks(10, ages=list(range(10)))
    result = movements_plan(snapshot=snapshot(host_policy(demote_tier="remote")), dry_run=True)
    assert {(m.route, m.dst_node) for m in result.movements} == {("host->remote", "")}


def test_a_full_tier_below_means_eviction(db, make_blocks):
    node_report("gpu-0", host=(10 * B, 10 * B), disk=(10 * B, 9 * B))
    make_blocks(10, ages=list(range(10)))
    result = movements_plan(
        snapshot=snapshot(host_policy(), TierPolicySpec(tier="disk", high_watermark=0.95)), dry_run=True
    )
    kinds = [m.kind for m in result.movements]
    # The disk takes half a block below its watermark: none fits, so every victim is evicted.
    assert kinds == [MovementKind.EVICT] * 5


def test_plan_writes_movements_and_a_second_plan_does_not_pick_them_again(full_node, make_blocks):
    make_blocks(10, ages=list(range(10)))
    first = movements_plan(snapshot=snapshot(host_policy()), reason=MovementReason.WATERMARK)
    assert len(first.written) == 5
    rows = list(Movement.objects.filter(id__in=first.written))
    assert {r.state for r in rows} == {MovementState.PLANNED}  # dispatched once the transaction commits
    assert {(r.reason, r.policy_version, r.exec_node, r.src_tier, r.dst_tier) for r in rows} == {
        ("watermark", 7, "gpu-0", "host", "disk")
    }
    assert all(r.src_epoch == Placement.objects.get(id=r.src_placement_id).epoch for r in rows)
    # The node still reports the same use: what is already leaving counts, nothing new is planned.
    second = movements_plan(snapshot=snapshot(host_policy()), reason=MovementReason.WATERMARK)
    assert second.movements == []


def test_the_database_refuses_a_second_in_flight_movement_of_a_block(full_node, make_blocks):
    make_blocks(10, ages=list(range(10)))
    first = movements_plan(snapshot=snapshot(host_policy()))
    row = Movement.objects.get(id=first.written[0])
    twin = Movement(
        plan=row.plan,
        block_id=row.block_id,
        kind=row.kind,
        reason=row.reason,
        state=MovementState.RUNNING,
        src_placement_id=row.src_placement_id,
        src_epoch=row.src_epoch,
        src_tier="host",
        src_node="gpu-0",
        dst_tier="disk",
        dst_node="gpu-0",
        exec_node="gpu-0",
        created_at=timezone.now(),
    )
    with pytest.raises(IntegrityError, match="movement_one_in_flight_per_block"), transaction.atomic():
        twin.save()
    # Once the first one finished, the block may move again.
    Movement.objects.filter(id=row.id).update(state=MovementState.DONE)
    twin.save()


def test_bad_input_names_the_field(full_node):
    with pytest.raises(MovementError, match="reason: unknown reason 'whim'") as caught:
        movements_plan(snapshot=snapshot(host_policy()), reason="whim")
    assert caught.value.field == "reason"
    with pytest.raises(MovementError, match="node: no node named 'nope'") as caught:
        movements_plan(snapshot=snapshot(host_policy()), node="nope")
    assert caught.value.field == "node"
    with pytest.raises(MovementError, match="algorithm: unknown eviction algorithm 'mru'"):
        movements_plan(snapshot=snapshot(host_policy(algorithm="mru")), dry_run=True)


@pytest.mark.django_db(transaction=True)
def test_two_planners_at_once_never_move_a_block_twice(make_blocks, monkeypatch):
    from controlplane.movements import services

    monkeypatch.setattr(services, "movements_dispatch", lambda **kwargs: 0)  # nobody consumes these queues
    node_report("gpu-0", host=(40 * B, 40 * B), disk=(100 * B, 0))
    make_blocks(40, ages=list(range(40)))
    start = threading.Barrier(4)
    results, errors = [], []

    def run() -> None:
        try:
            start.wait()
            results.append(movements_plan(snapshot=snapshot(host_policy()), reason=MovementReason.WATERMARK))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    written = [ident for r in results for ident in r.written]
    blocks = list(Movement.objects.filter(id__in=written).values_list("block_id", flat=True))
    assert len(blocks) == len(set(blocks)) == 20  # down to the low watermark once, not four times
    assert sum(len(r.written) for r in results) == 20


def test_warm_brings_the_most_used_remote_blocks_to_a_node(db, make_blocks):
    node_report("gpu-0", host=(10 * B, 7 * B), remote=(100 * B, 5 * B))
    remote = make_blocks(5, tier="remote", node=None, accesses=[1, 50, 3, 20, 0])
    result = movements_warm(node="gpu-0", snapshot=snapshot(host_policy()), dry_run=True)
    # Room below the 90% watermark: 2 blocks (9 - 7); the most used remote blocks come first.
    assert victims(result) == [remote[1].id, remote[3].id]
    assert {(m.kind, m.route, m.exec_node) for m in result.movements} == {("warm", "remote->host", "gpu-0")}
    with pytest.raises(MovementError, match="namespace: no namespace named 'ghost'"):
        movements_warm(node="gpu-0", namespace="ghost", snapshot=snapshot(host_policy()), dry_run=True)


def test_expiry_is_measured_from_the_plan_time(full_node, make_blocks):
    now = timezone.now()
    make_blocks(2, ages=[100, 100], now=now)
    node_report("gpu-0", host=(100 * B, 2 * B), disk=(100 * B, 0))
    policy = snapshot(host_policy(ttl_seconds=3600))
    assert movements_plan(snapshot=policy, dry_run=True, now=now).movements == []
    assert len(movements_plan(snapshot=policy, dry_run=True, now=now + timedelta(hours=2)).movements) == 2


def test_a_victim_already_held_below_is_evicted_not_copied_again(full_node, make_blocks, profile):
    from controlplane.directory.services import blocks_register
    from worker.dataplane.directory import BlockRegistration

    blocks = make_blocks(10, ages=[50, 10, 90, 30, 70, 20, 80, 40, 60, 0])
    idlest = blocks[2]
    # The idlest block also has a servable copy on gpu-0's disk (e.g. warmed back up earlier).
    blocks_register(
        registrations=[
            BlockRegistration(
                namespace="tenant-a",
                model_key=profile.model_key,
                prefix_key=idlest.prefix_key,
                content_key=idlest.content_key,
                position=0,
                tokens=idlest.token_count,
                tier="disk",
                node="gpu-0",
                nbytes=B,
                checksum="0" * 32,
            )
        ]
    )
    result = movements_plan(snapshot=snapshot(host_policy(algorithm="lru")), dry_run=True)
    by_block = {m.block_id: m for m in result.movements}
    assert by_block[idlest.id].kind == MovementKind.EVICT
    assert by_block[idlest.id].detail == "a copy is already held in disk"
    assert [m.kind for m in result.movements if m.block_id != idlest.id] == [MovementKind.MOVE] * 4
