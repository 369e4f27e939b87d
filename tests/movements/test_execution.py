"""Executing movements against a real TieredStore (host pool in /dev/shm, disk files, remote in
Redis) and the real PostgreSQL: bytes stay identical across host -> disk -> remote -> host, a
stale epoch is refused, running twice gives the same end state, corrupt copies are found."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, Placement
from controlplane.directory.services import (
    placement_create_pending,
    placement_flip,
    placement_mark_corrupt,
)
from controlplane.movements.choices import MovementKind, MovementState
from controlplane.movements.models import Movement, MovementTally
from controlplane.movements.planner import PlannedMovement
from controlplane.movements.services import movements_record
from tests.movements.conftest import (
    BLOCK_BYTES,
    flip_a_data_byte,
    node_report,
    placements,
    random_block,
)
from tests.movements.invariants import invariants_check
from worker.dataplane.errors import TierFull, TierUnavailable
from worker.movement_executor import MovementExecutor, MovementOptions

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db):  # type: ignore[no-untyped-def]
    return node_report("gpu-0", host=(16 * B, 0), disk=(16 * B, 0), remote=(16 * B, 0))


@pytest.fixture
def store(store_factory):  # type: ignore[no-untyped-def]
    return store_factory()


@pytest.fixture
def executor(node, store):  # type: ignore[no-untyped-def]
    return MovementExecutor(node="gpu-0", store=store, options=MovementOptions(reconcile_grace_s=0))


@pytest.fixture
def stored_block(store, make_blocks):  # type: ignore[no-untyped-def]
    """Write random blocks into a tier and register their READY copies with the real checksums."""

    def build(tier: str = "host", *, seed: int = 0) -> tuple[Block, torch.Tensor]:
        key = uuid.uuid4()
        data = random_block(store.layout, seed)
        result = store.put(key, data, tier=tier)
        block = make_blocks(
            1, tier=tier, node=None if tier == "remote" else "gpu-0", keys=[key], checksums=[result.checksum.hex]
        )[0]
        return block, data.clone()

    return build


def movement(block: Block, kind: str, dst_tier: str = "", *, src_tier: str | None = None) -> Movement:
    source = Placement.objects.get(block=block, tier=src_tier) if src_tier else Placement.objects.get(block=block)
    planned = PlannedMovement(
        block_id=block.id,
        kind=kind,
        reason="manual",
        src_placement_id=source.id,
        src_epoch=source.epoch,
        src_tier=source.tier,
        src_node=source.node.name if source.node else "",
        dst_tier=dst_tier,
        dst_node="" if dst_tier in ("", "remote") else "gpu-0",
        exec_node="gpu-0",
        bytes=source.size_bytes,
    )
    [ident] = movements_record(
        plan_id=uuid.uuid4(), movements=[planned], policy_version=3, mode="", now=source.updated_at
    )
    return Movement.objects.get(id=ident)


def read(store, block: Block, tier: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = store.layout.empty()
    store.tier(tier).get(block.prefix_key, out)
    return out


def test_move_host_disk_remote_and_warm_back_keeps_the_bytes(executor, store, stored_block):
    block, original = stored_block("host", seed=1)
    for dst in ("disk", "remote"):
        m = movement(block, MovementKind.MOVE, dst)
        [outcome] = executor.run("move", [m.id])
        assert outcome.state == MovementState.DONE, outcome.detail
        assert placements(block) == {(dst, "" if dst == "remote" else "gpu-0"): PlacementState.READY}
        assert torch.equal(read(store, block, dst), original)
        assert store.contains(block.prefix_key) == (dst,)
        done = Movement.objects.get(id=m.id)
        assert (done.state, done.bytes, done.attempts) == (MovementState.DONE, B, 1)
        assert done.duration_s is not None and done.finished_at is not None
    warm = movement(block, MovementKind.WARM, "host")
    assert executor.run("warm", [warm.id])[0].state == MovementState.DONE
    # Warming keeps the shared remote copy.
    assert placements(block) == {("remote", ""): PlacementState.READY, ("host", "gpu-0"): PlacementState.READY}
    assert torch.equal(read(store, block, "host"), original)
    tallies = {(t.kind, t.src_tier, t.dst_tier, t.result): (t.blocks, t.bytes) for t in MovementTally.objects.all()}
    assert tallies == {
        ("move", "host", "disk", "done"): (1, B),
        ("move", "disk", "remote", "done"): (1, B),
        ("warm", "remote", "host", "done"): (1, B),
    }
    report = invariants_check(stores={"gpu-0": store})
    assert report.ok, report.violations
    assert report.checked == 2


def test_evict_frees_the_copy(executor, store, stored_block):
    block, _ = stored_block("disk")
    m = movement(block, MovementKind.EVICT)
    assert executor.run("evict", [m.id])[0].state == MovementState.DONE
    assert placements(block) == {}
    assert store.contains(block.prefix_key) == ()
    assert MovementTally.objects.get(kind="evict").blocks == 1


def test_running_a_movement_twice_gives_the_same_end_state(executor, store, stored_block):
    block, original = stored_block("host", seed=2)
    m = movement(block, MovementKind.MOVE, "disk")
    assert executor.run("move", [m.id])[0].state == MovementState.DONE
    again = executor.run("move", [m.id])
    assert again[0].state == "skipped"
    assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}
    assert torch.equal(read(store, block, "disk"), original)
    assert Movement.objects.get(id=m.id).attempts == 1


def test_a_move_resumed_after_its_flip_frees_the_source(executor, store, stored_block):
    """A worker that flipped and died before freeing the source: the redelivered task finishes."""
    block, original = stored_block("host", seed=3)
    m = movement(block, MovementKind.MOVE, "disk")
    Movement.objects.filter(id=m.id).update(state=MovementState.RUNNING, attempts=1)
    source = Placement.objects.get(id=m.src_placement_id)
    target = placement_create_pending(block_id=block.id, tier="disk", node="gpu-0", size_bytes=B)
    Movement.objects.filter(id=m.id).update(dst_placement_id=target.id)
    store.put(block.prefix_key, original.clone(), tier="disk")
    placement_flip(
        source_id=source.id,
        source_epoch=source.epoch,
        target_id=target.id,
        target_epoch=target.epoch,
        checksum=source.checksum,
    )
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.DONE and "resumed after the flip" in outcome.detail
    assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}
    assert store.contains(block.prefix_key) == ("disk",)
    assert invariants_check(stores={"gpu-0": store}).ok


def test_a_move_resumed_before_its_flip_takes_its_pending_target_over(executor, store, stored_block):
    block, original = stored_block("host", seed=4)
    m = movement(block, MovementKind.MOVE, "disk")
    Movement.objects.filter(id=m.id).update(state=MovementState.RUNNING, attempts=1)
    stale = placement_create_pending(block_id=block.id, tier="disk", node="gpu-0", size_bytes=B)
    Movement.objects.filter(id=m.id).update(dst_placement_id=stale.id)
    store.put(block.prefix_key, torch.zeros_like(original), tier="disk")  # the dead attempt's half-work
    assert executor.run("move", [m.id])[0].state == MovementState.DONE
    target = Placement.objects.get(block=block)
    assert (target.tier, target.state) == ("disk", PlacementState.READY)
    assert target.epoch > stale.epoch  # taken over with a fresh epoch: the old attempt can no longer flip
    assert torch.equal(read(store, block, "disk"), original)


def test_a_copy_changed_since_planning_is_not_moved(executor, store, stored_block):
    block, _ = stored_block("host", seed=5)
    m = movement(block, MovementKind.MOVE, "disk")
    source = Placement.objects.get(id=m.src_placement_id)
    placement_mark_corrupt(placement_id=source.id)  # someone else quarantined it meanwhile
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.CANCELLED
    assert "changed since planning" in outcome.detail
    assert ("disk", "gpu-0") not in placements(block)
    assert "disk" not in store.contains(block.prefix_key)


def test_a_refused_flip_drops_its_target_and_serves_nothing(executor, store, stored_block, monkeypatch):
    """Between copy and flip someone else changes the source: the flip is refused by the epoch."""
    block, original = stored_block("host", seed=6)
    m = movement(block, MovementKind.MOVE, "disk")
    import worker.movement_executor.executor as glue

    real_flip = glue.placements_flip_many

    def flip_after_a_rival(**kwargs):  # type: ignore[no-untyped-def]
        for flip in kwargs["flips"]:
            Placement.objects.filter(id=flip.source_id).update(epoch=flip.source_epoch + 5)
        return real_flip(**kwargs)

    monkeypatch.setattr(glue, "placements_flip_many", flip_after_a_rival)
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.CANCELLED and "flip refused" in outcome.detail
    assert placements(block) == {("host", "gpu-0"): PlacementState.READY}
    assert store.contains(block.prefix_key) == ("host",)
    assert torch.equal(read(store, block, "host"), original)


def test_a_disk_copy_is_made_durable_before_its_flip(executor, store, stored_block, monkeypatch):
    """The disk tier syncs the directories of its renames in the background; a move asks for
    it at once, before the copy is recorded READY (a crash after the flip cannot lose it)."""
    block, _ = stored_block("host", seed=11)
    m = movement(block, MovementKind.MOVE, "disk")
    import worker.movement_executor.executor as glue

    order: list[str] = []
    disk = store.tier("disk")
    real_sync, real_flip = disk.sync, glue.placements_flip_many
    monkeypatch.setattr(disk, "sync", lambda: (order.append("sync"), real_sync())[1])
    monkeypatch.setattr(glue, "placements_flip_many", lambda **kw: (order.append("flip"), real_flip(**kw))[1])
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.DONE, outcome.detail
    assert order == ["sync", "flip"]


def test_a_copy_that_cannot_be_made_durable_is_not_flipped(executor, store, stored_block, monkeypatch):
    block, original = stored_block("host", seed=12)
    m = movement(block, MovementKind.MOVE, "disk")

    def unsyncable() -> None:
        raise TierUnavailable("disk", reason="syncing the directory /x failed: EIO (Input/output error)")

    monkeypatch.setattr(store.tier("disk"), "sync", unsyncable)
    with pytest.raises(TierUnavailable):  # transient: the task retries the movement
        executor.run("move", [m.id])
    ready = {where for where, state in placements(block).items() if state == PlacementState.READY}
    assert ready == {("host", "gpu-0")}  # the source stays the READY copy; the target never was
    assert torch.equal(read(store, block, "host"), original)
    monkeypatch.undo()
    [outcome] = executor.run("move", [m.id])  # the retry, once the disk syncs again
    assert outcome.state == MovementState.DONE, outcome.detail
    assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}


def _disk_file(store, block: Block):  # type: ignore[no-untyped-def]
    return store.tier("disk").path_of(block.prefix_key)


def test_a_corrupt_source_is_quarantined_not_moved(executor, store, stored_block):
    block, _ = stored_block("disk", seed=7)
    flip_a_data_byte(_disk_file(store, block))
    m = movement(block, MovementKind.MOVE, "remote")
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.FAILED and "quarantined" in outcome.detail
    assert placements(block) == {("disk", "gpu-0"): PlacementState.CORRUPT}
    assert store.contains(block.prefix_key) == ()
    assert MovementTally.objects.get(kind="scrub", src_tier="disk").blocks == 1
    assert invariants_check(stores={"gpu-0": store}).ok


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "swap two files"])
def test_scrub_finds_damaged_block_files(executor, store, stored_block, damage):
    first, _ = stored_block("disk", seed=8)
    second, _ = stored_block("disk", seed=9)
    healthy, original = stored_block("disk", seed=10)
    path = _disk_file(store, first)
    if damage == "flip a byte":
        flip_a_data_byte(path)
        damaged = [first]
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
        damaged = [first]
    else:
        other = _disk_file(store, second)
        tmp = path.with_suffix(".swap")
        os.rename(path, tmp)
        os.rename(other, path)
        os.rename(tmp, other)
        damaged = [first, second]
    before = invariants_check(stores={"gpu-0": store})
    assert not before.ok and {v.block_id for v in before.violations} == {b.id for b in damaged}
    report = executor.scrub("disk")
    assert report.checked == 3 and report.corrupt == len(damaged)
    for block in damaged:
        assert placements(block) == {("disk", "gpu-0"): PlacementState.CORRUPT}
    assert placements(healthy) == {("disk", "gpu-0"): PlacementState.READY}
    assert torch.equal(read(store, healthy, "disk"), original)
    assert invariants_check(stores={"gpu-0": store}).ok


def test_reconcile_collects_orphans_after_the_grace_period_and_marks_vanished_copies(node, store, stored_block):
    executor = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(reconcile_grace_s=60))
    orphan = uuid.uuid4()
    store.put(orphan, random_block(store.layout, 11), tier="disk")
    vanished, _ = stored_block("disk", seed=12)
    kept, _ = stored_block("disk", seed=13)
    store.tier("disk").delete(vanished.prefix_key)
    assert invariants_check(stores={"gpu-0": store}).orphans == [("gpu-0", "disk", orphan)]
    first = executor.reconcile("disk", now=1000.0)
    assert (first.orphans_seen, first.orphans_deleted, first.missing_marked) == (1, 0, 1)
    assert store.contains(orphan) == ("disk",)  # maybe a write not registered yet: not collected
    later = executor.reconcile("disk", now=1061.0)
    assert later.orphans_deleted == 1
    assert store.contains(orphan) == ()
    assert placements(vanished) == {("disk", "gpu-0"): PlacementState.CORRUPT}
    assert placements(kept) == {("disk", "gpu-0"): PlacementState.READY}
    report = invariants_check(stores={"gpu-0": store})
    assert report.ok and report.orphans == []


def test_a_full_target_tier_fails_the_move_and_keeps_the_source(node, store_factory, stored_block, make_blocks):
    small = store_factory(disk_bytes=2 * B, tiers=("host", "disk"))  # one block file: header + data
    executor = MovementExecutor(node="gpu-0", store=small)
    filler = uuid.uuid4()
    small.put(filler, random_block(small.layout, 14), tier="disk")
    key = uuid.uuid4()
    data = random_block(small.layout, 15)
    checksum = small.put(key, data, tier="host").checksum.hex
    block = make_blocks(1, keys=[key], checksums=[checksum])[0]
    m = movement(block, MovementKind.MOVE, "disk")
    [outcome] = executor.run("move", [m.id])
    assert outcome.state == MovementState.FAILED and "full" in outcome.detail
    assert placements(block) == {("host", "gpu-0"): PlacementState.READY}
    assert small.contains(key) == ("host",)


def test_a_warm_up_from_a_corrupt_remote_copy_leaves_nothing_in_the_host_pool(executor, store, stored_block):
    # The host target is written in place (the remote value is received straight into its slot):
    # a copy that fails its checksums there is never published, and its slot is given back.
    block, _ = stored_block("remote", seed=16)
    remote = store.tier("remote")
    name = remote.key_name(block.prefix_key)
    offset = remote.header_bytes + store.layout.layer_bytes + 3
    byte = remote.client.getrange(name, offset, offset)
    remote.client.setrange(name, offset, bytes([byte[0] ^ 0x80]))
    free_before = store.tier("host").usage().free_bytes
    warm = movement(block, MovementKind.WARM, "host")
    [outcome] = executor.run("warm", [warm.id])
    assert outcome.state == MovementState.FAILED and "quarantined" in outcome.detail
    assert placements(block) == {("remote", ""): PlacementState.CORRUPT}
    assert store.contains(block.prefix_key) == ()
    assert store.tier("host").usage().free_bytes == free_before
    assert invariants_check(stores={"gpu-0": store}).ok


def test_a_warm_up_into_a_full_host_pool_fails_and_keeps_the_remote_copy(node, store_factory, make_blocks):
    small = store_factory(blocks=2)
    executor = MovementExecutor(node="gpu-0", store=small)
    fillers = []
    with pytest.raises(TierFull):
        while True:
            small.put(filler := uuid.uuid4(), random_block(small.layout, 17), tier="host")
            fillers.append(filler)
    key = uuid.uuid4()
    data = random_block(small.layout, 18)
    checksum = small.put(key, data, tier="remote").checksum.hex
    block = make_blocks(1, tier="remote", node=None, keys=[key], checksums=[checksum])[0]
    warm = movement(block, MovementKind.WARM, "host")
    [outcome] = executor.run("warm", [warm.id])
    assert outcome.state == MovementState.FAILED and "full" in outcome.detail
    assert placements(block) == {("remote", ""): PlacementState.READY}
    assert small.contains(key) == ("remote",)
    assert fillers and all(small.contains(filler) == ("host",) for filler in fillers)
    assert torch.equal(read(small, block, "remote"), data)


def test_a_node_without_a_model_records_why_it_cannot_move(node, make_blocks):
    block = make_blocks(1)[0]
    m = movement(block, MovementKind.MOVE, "disk")
    [outcome] = MovementExecutor(node="gpu-0", store=None).run("move", [m.id])
    assert outcome.state == MovementState.FAILED
    assert (
        Movement.objects.get(id=m.id).error == "node gpu-0 serves no model: it has no tiered store to move bytes with"
    )


def test_a_movement_of_another_node_is_refused(node, store, stored_block):
    from controlplane.movements.errors import MovementError

    block, _ = stored_block("host")
    m = movement(block, MovementKind.MOVE, "disk")
    with pytest.raises(MovementError, match="node: movement .* belongs to node 'gpu-0', not 'gpu-9'"):
        MovementExecutor(node="gpu-9", store=store).run("move", [m.id])


def test_bad_movement_options_name_the_variable():
    with pytest.raises(ValueError, match="STRATA_FAULT_POINT: expected one of after-reserve, after-copy, after-flip"):
        MovementOptions.from_environ({"STRATA_FAULT_POINT": "somewhere"})
    with pytest.raises(ValueError, match="STRATA_MOVE_VERIFY: expected one of full, header, got 'some'"):
        MovementOptions.from_environ({"STRATA_MOVE_VERIFY": "some"})
    with pytest.raises(ValueError, match="STRATA_RECONCILE_GRACE_S: expected a number of seconds, got 'soon'"):
        MovementOptions.from_environ({"STRATA_RECONCILE_GRACE_S": "soon"})
    assert MovementOptions.from_environ({}).fault_point == ""
