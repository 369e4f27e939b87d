"""The planner's quota pass on the real PostgreSQL: two tenants where one floods a tier; only the
flooder's coldest copies leave, the other tenant's stay even when they are colder; quotas below
limit where victims go; the remote quota is fleet-wide; the beat task runs the pass; and the node's
executor carries the plan out on a real tiered store with the bytes intact."""

from __future__ import annotations

import uuid

import pytest
import torch
from django_celery_beat.models import PeriodicTask

from controlplane.directory.models import Placement
from controlplane.movements.choices import MovementKind, MovementReason
from controlplane.movements.models import Movement
from controlplane.movements.services import movements_plan
from controlplane.movements.tasks import movements_plan_quotas_task
from controlplane.policies.quotas import namespacequota_create
from controlplane.policies.selectors import quota_usage
from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec
from controlplane.policies.specs import QuotaSpec
from tests.movements.conftest import BLOCK_BYTES, node_report, random_block, read_block
from tests.movements.invariants import invariants_check

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db

HOST_LRU = TierPolicySpec(tier="host", high_watermark=0.9, low_watermark=0.5, algorithm="lru")


def policies(*quotas: QuotaSpec, tiers: tuple[TierPolicySpec, ...] = (HOST_LRU,)) -> PolicySnapshot:
    return PolicySnapshot(version=3, mode="", classes=(), tiers=tiers, quotas=quotas)


def namespace_of(movement) -> str:  # type: ignore[no-untyped-def]
    return Placement.objects.get(id=movement.src_placement_id).block.namespace.name


def test_only_the_flooders_coldest_blocks_leave_and_the_other_tenant_is_untouched(make_blocks):
    node_report("gpu-0", host=(100 * B, 30 * B), disk=(100 * B, 0))  # far below the host's watermark
    flooder = make_blocks(20, namespace="tenant-a", ages=[float(10 * i) for i in range(20)])
    # The quiet tenant's blocks are colder than any of the flooder's: an LRU over the tier would
    # take them first.
    quiet = make_blocks(10, namespace="realtime", ages=[10_000.0] * 10)
    quota = QuotaSpec(namespace="tenant-a", tier="host", bytes=5 * B)

    result = movements_plan(snapshot=policies(quota), dry_run=True)
    assert [m.block_id for m in result.movements] == [b.id for b in reversed(flooder[5:])]
    assert {(m.kind, m.route, m.reason) for m in result.movements} == {("move", "host->disk", "quota")}
    assert result.movements[0].detail == f"namespace tenant-a over its host quota ({20 * B} of {5 * B} bytes)"

    written = movements_plan(snapshot=policies(quota), reason=MovementReason.WATERMARK)
    assert len(written.written) == 15
    rows = list(Movement.objects.all())
    assert {namespace_of(m) for m in rows} == {"tenant-a"} and {m.reason for m in rows} == {"quota"}
    assert not Movement.objects.filter(block_id__in=[b.id for b in quiet]).exists()
    # What is already leaving counts: planning again finds the flooder at its quota.
    assert movements_plan(snapshot=policies(quota), dry_run=True).movements == []


def test_under_pressure_the_namespace_over_quota_pays_first(make_blocks):
    # Host full: 20 B used of 20 B (high 18 B, low 10 B). The quiet tenant's 6 blocks are the
    # coldest; without a quota they would leave first.
    node_report("gpu-0", host=(20 * B, 20 * B), disk=(100 * B, 0))
    flooder = make_blocks(14, namespace="tenant-a", ages=[float(i) for i in range(14)])
    quiet = make_blocks(6, namespace="realtime", ages=[10_000.0] * 6)

    plain = movements_plan(snapshot=policies(), dry_run=True)
    assert {b.id for b in quiet} <= {m.block_id for m in plain.movements}

    result = movements_plan(snapshot=policies(QuotaSpec("tenant-a", "host", 4 * B)), dry_run=True)
    # The quota pass takes the flooder's 10 coldest, which also brings the tier to its low watermark.
    assert [m.block_id for m in result.movements] == [b.id for b in reversed(flooder[4:])]
    assert {m.reason for m in result.movements} == {"quota"}
    assert not {b.id for b in quiet} & {m.block_id for m in result.movements}


def test_the_watermark_pass_never_picks_a_copy_the_quota_pass_took(make_blocks):
    # The flooder's blocks are the coldest of the tier: the watermark pass would pick the quota
    # pass's victim again if it did not skip it.
    node_report("gpu-0", host=(20 * B, 20 * B), disk=(100 * B, 0))
    flooder = make_blocks(10, namespace="tenant-a", ages=[20_000.0 + i for i in range(10)])
    make_blocks(10, namespace="realtime", ages=[float(i) for i in range(10)])
    result = movements_plan(snapshot=policies(QuotaSpec("tenant-a", "host", 9 * B)), dry_run=True)
    assert [m.reason for m in result.movements] == ["quota"] + ["schedule"] * 9  # the quota pass comes first
    ids = [m.block_id for m in result.movements]
    assert len(ids) == len(set(ids)) and set(ids) == {b.id for b in flooder}
    assert result.summary()["bytes_moved"] == 10 * B  # down to the low watermark, no more


def test_a_quota_below_limits_where_victims_go(make_blocks):
    node_report("gpu-0", host=(100 * B, 10 * B), disk=(100 * B, 0))
    flooder = make_blocks(10, namespace="tenant-a", ages=[float(10 * i) for i in range(10)])
    result = movements_plan(
        snapshot=policies(QuotaSpec("tenant-a", "host", 4 * B), QuotaSpec("tenant-a", "disk", 2 * B)), dry_run=True
    )
    coldest_first = [b.id for b in reversed(flooder[4:])]
    assert [m.block_id for m in result.movements] == coldest_first
    assert [m.kind for m in result.movements] == [MovementKind.MOVE] * 2 + [MovementKind.EVICT] * 4
    assert result.movements[-1].detail.endswith("no tier below with room (or quota) for it")


def test_the_remote_quota_is_fleet_wide_and_only_in_fleet_plans(make_blocks):
    node_report("gpu-0", host=(100 * B, 0), remote=(1000 * B, 8 * B))
    node_report("gpu-1", host=(100 * B, 0), remote=(1000 * B, 8 * B))
    flooder = make_blocks(6, tier="remote", namespace="tenant-a", ages=[float(i) for i in range(6)])
    make_blocks(2, tier="remote", namespace="realtime", ages=[99_999.0] * 2)
    snapshot = policies(QuotaSpec("tenant-a", "remote", 2 * B))
    result = movements_plan(snapshot=snapshot, dry_run=True)
    assert [m.block_id for m in result.movements] == [b.id for b in reversed(flooder[2:])]
    assert {(m.kind, m.src_tier, m.reason) for m in result.movements} == {("evict", "remote", "quota")}
    assert {m.exec_node for m in result.movements} == {"gpu-0", "gpu-1"}  # remote work in turn
    assert movements_plan(snapshot=snapshot, node="gpu-0", dry_run=True).movements == []


def test_the_quota_beat_runs_the_pass(make_blocks, namespaces):
    node_report("gpu-0", host=(100 * B, 8 * B), disk=(100 * B, 0))
    flooder = make_blocks(6, namespace="tenant-a", ages=[float(i) for i in range(6)])
    make_blocks(2, namespace="realtime", ages=[99_999.0] * 2)
    entry = PeriodicTask.objects.get(task="movements.plan_quotas")
    assert entry.interval.every == 60 and entry.interval.period == "seconds" and entry.queue == "control"
    assert entry.enabled

    assert movements_plan_quotas_task()["written"] == 0  # no quotas: nothing to do
    namespacequota_create(namespace="tenant-a", tier="host", bytes=2 * B)
    summary = movements_plan_quotas_task()
    assert summary["written"] == 4 and summary["moves"] == 4
    assert sorted(Movement.objects.values_list("block_id", flat=True)) == sorted(b.id for b in flooder[2:])
    assert set(Movement.objects.values_list("reason", flat=True)) == {"quota"}


def test_a_node_carries_out_the_quota_plan_on_a_real_store(make_blocks, store_factory):
    from worker.movement_executor import MovementExecutor, MovementOptions

    node_report("gpu-0", host=(16 * B, 12 * B), disk=(16 * B, 0))
    store = store_factory(blocks=16, tiers=("host", "disk"))
    written: dict[str, list] = {"tenant-a": [], "realtime": []}
    for i, namespace in enumerate(["tenant-a"] * 8 + ["realtime"] * 4):
        key, data = uuid.uuid4(), random_block(store.layout, i)
        result = store.put(key, data, tier="host")
        [block] = make_blocks(
            1, namespace=namespace, keys=[key], checksums=[result.checksum.hex], ages=[100.0 * (12 - i)]
        )
        written[namespace].append((block, data.clone()))
    namespacequota_create(namespace="tenant-a", tier="host", bytes=3 * B)

    plan = movements_plan_quotas_task()
    assert plan["moves"] == 5 and plan["written"] == 5
    executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(reconcile_grace_s=0))
    outcomes = executor.run("move", list(Movement.objects.order_by("id").values_list("id", flat=True)))
    assert {o.state for o in outcomes} == {"done"}

    # The flooder's five coldest now live on disk, byte for byte; its three newest and every block
    # of the quiet tenant stay in the host pool.
    for block, data in written["tenant-a"][:5]:
        assert store.contains(block.prefix_key) == ("disk",)
        assert torch.equal(read_block(store, block, "disk"), data)
    for block, data in written["tenant-a"][5:] + written["realtime"]:
        assert store.contains(block.prefix_key) == ("host",)
        assert torch.equal(read_block(store, block, "host"), data)
    [host] = quota_usage(namespace="tenant-a")[:1]
    assert (host["tier"], host["used_bytes"], host["quota_bytes"], host["over"]) == ("host", 3 * B, 3 * B, False)
    report = invariants_check(stores={"gpu-0": store})
    assert report.ok, report.violations
