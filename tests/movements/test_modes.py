"""The seeds' load modes change where blocks live: the built-in modes (seeded by the policies app's
migration) are switched on with the real services, the real planner plans, and the movements are
executed against a real tiered store (host pool, disk files, remote in Redis)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import torch
from django.utils import timezone

from controlplane.directory.models import Placement
from controlplane.movements.services import movements_plan
from controlplane.policies.services import mode_activate
from tests.movements.conftest import BLOCK_BYTES, node_report, random_block
from tests.movements.invariants import invariants_check
from worker.movement_executor import MovementExecutor, MovementOptions

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db


@pytest.fixture
def store(store_factory):  # type: ignore[no-untyped-def]
    return store_factory(blocks=16)


@pytest.fixture
def seeded(store, make_blocks):  # type: ignore[no-untyped-def]
    """gpu-0's host pool holds ten blocks of real bytes (10 of 16 blocks' room): the first five idle
    for an hour and read once, the last five read a moment ago, many times."""
    node_report("gpu-0", host=(16 * B, 10 * B), disk=(16 * B, 0), remote=(64 * B, 0))
    keys, data, sums = [], [], []
    for seed in range(10):
        key = uuid.uuid4()
        block = random_block(store.layout, seed)
        sums.append(store.put(key, block, tier="host").checksum.hex)
        keys.append(key)
        data.append(block.clone())
    blocks = make_blocks(10, keys=keys, checksums=sums, ages=[3600.0] * 5 + [5.0] * 5, accesses=[1] * 5 + [40] * 5)
    return blocks, dict(zip(keys, data, strict=True))


def _execute(store, result) -> None:  # type: ignore[no-untyped-def]
    """Run what the planner wrote, as gpu-0's worker would (one task per kind)."""
    from controlplane.movements.models import Movement

    executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(reconcile_grace_s=0))
    by_kind: dict[str, list[int]] = {}
    for movement in Movement.objects.filter(id__in=result.written).order_by("id"):
        by_kind.setdefault(movement.kind, []).append(movement.id)
    for kind, ids in by_kind.items():
        executor.run(kind, ids)


def _tiers(blocks) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for p in Placement.objects.filter(block__in=blocks, state="ready"):
        counts[p.tier] = counts.get(p.tier, 0) + 1
    return counts


def _bytes_intact(store, blocks, data) -> None:  # type: ignore[no-untyped-def]
    for block in blocks:
        out = store.layout.empty()
        got = store.get(block.prefix_key, out=out)
        assert torch.equal(got.data, data[block.prefix_key]), f"block {block.id} changed while moving"


def test_normal_policies_move_host_blocks_down_and_long_doc_keeps_them_on_host(store, seeded):
    blocks, data = seeded
    # Normal: the host tier may use half the pool (8 blocks), so 10 blocks breach 90% of it.
    normal = movements_plan(node="gpu-0", reason="schedule", dry_run=True)
    assert normal.summary()["moves"] > 0
    assert {m.src_tier for m in normal.movements} == {"host"}

    mode_activate(name="long-doc", comment="test: long documents arrive")
    result = movements_plan(node="gpu-0", reason="mode-switch")
    assert result.mode == "long-doc" and result.summary()["moves"] == 0 and not result.written
    assert _tiers(blocks) == {"host": 10}


def test_normal_mode_demotes_what_long_doc_would_keep(store, seeded):
    blocks, data = seeded
    result = movements_plan(node="gpu-0", reason="schedule")
    _execute(store, result)
    tiers = _tiers(blocks)
    assert tiers["host"] <= 6 and tiers["host"] + tiers.get("disk", 0) == 10
    # The least used blocks went down; the hot ones stayed.
    hot = {b.id for b in blocks[5:]}
    assert hot <= {p.block_id for p in Placement.objects.filter(block__in=blocks, tier="host", state="ready")}
    _bytes_intact(store, blocks, data)
    assert invariants_check(stores={"gpu-0": store}).ok


def test_nightly_batch_moves_cold_host_blocks_to_remote(store, seeded):
    blocks, data = seeded
    mode_activate(name="nightly-batch", comment="test: the night's batch window")
    result = movements_plan(node="gpu-0", reason="mode-switch")
    _execute(store, result)
    cold = blocks[:5]
    # Every cold block is kept, only further away; the host tier is down to its low watermark (30%).
    assert {p.tier for p in Placement.objects.filter(block__in=cold, state="ready")} == {"remote"}
    assert result.summary()["evictions"] == 0
    tiers = _tiers(blocks)
    assert tiers["host"] * B <= 0.3 * 16 * B and tiers["host"] + tiers["remote"] == 10
    # Hot blocks leave last: whatever stays on host is hot.
    assert {p.block_id for p in Placement.objects.filter(block__in=blocks, tier="host")} <= {b.id for b in blocks[5:]}
    _bytes_intact(store, blocks, data)
    assert invariants_check(stores={"gpu-0": store}).ok


def test_switching_back_from_long_doc_demotes_again(store, seeded):
    blocks, _ = seeded
    mode_activate(name="long-doc")
    assert movements_plan(node="gpu-0", reason="mode-switch", dry_run=True).summary()["moves"] == 0
    from controlplane.policies.services import mode_deactivate

    mode_deactivate(name="long-doc")
    assert movements_plan(node="gpu-0", reason="mode-switch", dry_run=True).summary()["moves"] > 0


def test_the_ledger_records_the_mode_and_policy_version(store, seeded):
    from controlplane.movements.models import Movement

    version = mode_activate(name="nightly-batch")
    result = movements_plan(node="gpu-0", reason="mode-switch")
    rows = Movement.objects.filter(id__in=result.written)
    assert rows and {r.mode for r in rows} == {"nightly-batch"}
    assert {r.policy_version for r in rows} == {version.number}
    assert timezone.now() - max(r.created_at for r in rows) < timedelta(minutes=1)
