"""A batch of movements executed together against a real TieredStore and the real PostgreSQL:
reserved, copied through the pipeline and flipped in waves, each movement still concluded on its
own (a corrupt source fails only its own move, a stale one is only cancelled) and the bytes and
invariants stay right."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

import worker.dataplane.mover as mover
import worker.movement_executor.executor as glue
from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, Placement
from controlplane.directory.services import placement_mark_corrupt
from controlplane.movements.choices import MovementKind, MovementState
from controlplane.movements.models import Movement, MovementTally
from tests.movements.conftest import (
    BLOCK_BYTES,
    node_report,
    placements,
    random_block,
    read_block,
    record_moves,
)
from tests.movements.invariants import invariants_check
from worker.movement_executor import MovementExecutor, MovementOptions

B = BLOCK_BYTES
pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db):  # type: ignore[no-untyped-def]
    return node_report("gpu-0", host=(16 * B, 0), disk=(16 * B, 0), remote=(16 * B, 0))


@pytest.fixture
def store(store_factory):  # type: ignore[no-untyped-def]
    return store_factory()


def _blocks(store, make_blocks, tier: str, count: int) -> list[tuple[Block, torch.Tensor]]:  # type: ignore[no-untyped-def]
    made = []
    for seed in range(count):
        key = uuid.uuid4()
        data = random_block(store.layout, 100 + seed)
        checksum = store.put(key, data, tier=tier).checksum.hex
        [block] = make_blocks(
            1, tier=tier, node=None if tier == "remote" else "gpu-0", keys=[key], checksums=[checksum]
        )
        made.append((block, data.clone()))
    return made


@pytest.mark.parametrize("verify", ["full", "header"])
def test_a_batch_moves_in_waves_and_concludes_each_movement_on_its_own(node, store, make_blocks, monkeypatch, verify):
    monkeypatch.setattr(glue, "WAVE_BYTES", 2 * B)  # waves of two blocks: reserve, copy, flip overlap
    made = _blocks(store, make_blocks, "disk", 7)
    blocks = [block for block, _ in made]
    ids = record_moves(blocks, MovementKind.MOVE, "remote")
    corrupt, stale = blocks[2], blocks[5]
    path = store.tier("disk").path_of(corrupt.prefix_key)
    with open(path, "r+b") as f:  # one data byte of one source flipped on the medium
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(os.path.getsize(path) - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    placement_mark_corrupt(placement_id=Placement.objects.get(block=stale).id)  # changed since planning

    outcomes = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(verify=verify)).run("move", ids)

    states = {o.movement_id: o.state for o in outcomes}
    assert [o.movement_id for o in outcomes] == ids
    for (block, original), ident in zip(made, ids, strict=True):
        if block == corrupt:
            assert states[ident] == MovementState.FAILED
            assert "quarantined" in Movement.objects.get(id=ident).error
            assert placements(block) == {("disk", "gpu-0"): PlacementState.CORRUPT}
            assert store.contains(block.prefix_key) == ()
        elif block == stale:
            assert states[ident] == MovementState.CANCELLED
            assert "changed since planning" in Movement.objects.get(id=ident).detail
            assert placements(block) == {("disk", "gpu-0"): PlacementState.CORRUPT}
        else:
            assert states[ident] == MovementState.DONE
            assert placements(block) == {("remote", ""): PlacementState.READY}
            assert store.contains(block.prefix_key) == ("remote",)
            assert torch.equal(read_block(store, block, "remote"), original)
            copy = Placement.objects.get(block=block)
            assert copy.checksum == store.tier("remote").checksum(block.prefix_key).hex
    done = MovementTally.objects.get(kind="move", result="done")
    assert (done.blocks, done.bytes) == (5, 5 * B)
    assert all(m.attempts == 1 and m.duration_s is not None for m in Movement.objects.filter(id__in=ids))
    report = invariants_check(stores={"gpu-0": store})
    assert report.ok, report.violations

    # Delivered again (a duplicate message): every movement is finished, nothing changes.
    again = MovementExecutor(node="gpu-0", store=store).run("move", ids)
    assert {o.state for o in again} == {"skipped"}
    assert placements(blocks[0]) == {("remote", ""): PlacementState.READY}


def test_a_batch_of_warm_ups_keeps_the_remote_copies(node, store, make_blocks, monkeypatch):
    monkeypatch.setattr(glue, "WAVE_BYTES", 3 * B)
    made = _blocks(store, make_blocks, "remote", 5)
    ids = record_moves([block for block, _ in made], MovementKind.WARM, "host")
    outcomes = MovementExecutor(node="gpu-0", store=store).run("warm", ids + ids[:1])  # a duplicate id too
    assert [o.state for o in outcomes] == [MovementState.DONE] * 6
    for block, original in made:
        assert placements(block) == {("remote", ""): PlacementState.READY, ("host", "gpu-0"): PlacementState.READY}
        assert torch.equal(read_block(store, block, "host"), original)
    assert Movement.objects.filter(id__in=ids, attempts=1).count() == 5
    assert invariants_check(stores={"gpu-0": store}).ok


def test_an_attempt_whose_target_a_newer_attempt_took_over_steps_aside(node, store, make_blocks, monkeypatch):
    """Two attempts of one movement at once (a retried task while the first still runs): the
    older one's flip is refused and it neither drops the newer one's target nor records a result."""
    from controlplane.directory.services import placement_create_pending, placement_mark_deleting

    [(block, original)] = _blocks(store, make_blocks, "host", 1)
    [ident] = record_moves([block], MovementKind.MOVE, "disk")
    real_flip = glue.placements_flip_many
    newer = {}

    def flip_after_a_newer_attempt(**kwargs):  # type: ignore[no-untyped-def]
        [flip] = kwargs["flips"]
        target = Placement.objects.get(id=flip.target_id)
        placement_mark_deleting(placement_id=target.id, epoch=target.epoch)
        newer["target"] = placement_create_pending(block_id=block.id, tier="disk", node="gpu-0", size_bytes=B)
        return real_flip(**kwargs)

    monkeypatch.setattr(glue, "placements_flip_many", flip_after_a_newer_attempt)
    [outcome] = MovementExecutor(node="gpu-0", store=store).run("move", [ident])
    assert outcome.state == "skipped" and "taken over by a newer attempt" in outcome.detail
    assert Movement.objects.get(id=ident).state == MovementState.RUNNING  # the newer attempt records it
    target = Placement.objects.get(id=newer["target"].id)
    assert (target.state, target.epoch) == (PlacementState.PENDING, newer["target"].epoch)
    assert placements(block)[("host", "gpu-0")] == PlacementState.READY
    assert torch.equal(read_block(store, block, "host"), original)


def test_waves_keep_the_order_and_make_the_unhidden_first_and_last_waves_one_block():
    ids = list(range(10, 18))
    assert glue._waves(ids, 2) == [[10], [11, 12], [13, 14], [15, 16], [17]]
    assert glue._waves(ids, 3) == [[10], [11, 12, 13], [14, 15, 16], [17]]
    assert glue._waves(ids[:4], 2) == [[10, 11], [12, 13]]  # two waves: each already overlaps the other
    assert glue._waves(ids, 1) == [[i] for i in ids]
    assert glue._waves([], 2) == []
    for per_wave in range(1, 10):
        assert [i for wave in glue._waves(ids, per_wave) for i in wave] == ids


def test_the_copy_pipeline_reads_the_next_wave_ahead_and_every_copy_is_exact(node, store, make_blocks, monkeypatch):
    """Waves of two over nine moves, the puts slowed so each next wave is reserved while the current
    one is still copying: its first blocks are read into the freed buffers before its transfer starts
    (the pipeline does not drain between waves), and every target holds exactly its source's bytes."""
    monkeypatch.setattr(glue, "WAVE_BYTES", 2 * B)
    read_ahead = []
    job = mover.NextWave.job

    def counting(self, number):  # type: ignore[no-untyped-def]
        found = job(self, number)
        if found is not None:
            read_ahead.append(number)
        return found

    monkeypatch.setattr(mover.NextWave, "job", counting)
    write = mover.Mover._write_target

    def slow_write(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.1)
        return write(self, *args)

    monkeypatch.setattr(mover.Mover, "_write_target", slow_write)
    made = _blocks(store, make_blocks, "host", 9)
    ids = record_moves([block for block, _ in made], MovementKind.MOVE, "disk")

    outcomes = MovementExecutor(node="gpu-0", store=store, options=MovementOptions(verify="header")).run("move", ids)

    assert [o.state for o in outcomes] == [MovementState.DONE] * 9
    assert read_ahead, "no wave's first blocks were read ahead"
    for block, original in made:
        assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}
        assert torch.equal(read_block(store, block, "disk"), original)
    assert invariants_check(stores={"gpu-0": store}).ok
