"""A wave of movements costs a few statements whatever its size (bulk start, reserve, flip, free
and finish), and keeps every guarantee of the one-by-one path: a stale epoch is refused for its
own movement only, a failing copy fails alone, a resumed or finished movement shares a wave with
fresh ones, a retried batch changes nothing, and every result reaches the ledger and the tallies."""

from __future__ import annotations

import functools
import os
import uuid

import pytest
import torch
from django.db import connection
from django.test.utils import CaptureQueriesContext

import worker.movement_executor.executor as glue
from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, Placement
from controlplane.directory.services import (
    placement_create_pending,
    placement_flip,
    placement_mark_corrupt,
)
from controlplane.movements.choices import MovementKind, MovementState
from controlplane.movements.errors import MovementError
from controlplane.movements.models import Movement, MovementTally
from controlplane.movements.services import (
    MovementResult,
    movement_finish,
    movement_set_target,
    movement_start,
    movements_finish_many,
    movements_start_many,
)
from tests.movements.conftest import (
    BLOCK_BYTES,
    flip_a_data_byte,
    node_report,
    placements,
    random_block,
    read_block,
    record_moves,
)
from tests.movements.invariants import invariants_check
from worker.movement_executor import MovementExecutor

B = BLOCK_BYTES
_record = functools.partial(record_moves, policy_version=3)
pytestmark = pytest.mark.django_db

QUERIES_PER_WAVE = 22
"""Commands one wave of moves sends from its start to its recorded results, whatever its size:
12 statements and, in a test's transaction (where the wave's three transactions are savepoints),
10 savepoint commands. A wave of warm-ups sends fewer (no source to free). One by one, a move
cost about 30 per movement."""


@pytest.fixture
def node(db):  # type: ignore[no-untyped-def]
    node_report("gpu-9", host=(16 * B, 0))
    return node_report("gpu-0", host=(32 * B, 0), disk=(32 * B, 0), remote=(32 * B, 0))


@pytest.fixture
def store(store_factory):  # type: ignore[no-untyped-def]
    return store_factory(blocks=32)


def _blocks(store, make_blocks, tier: str, count: int) -> list[tuple[Block, torch.Tensor]]:  # type: ignore[no-untyped-def]
    keys = [uuid.uuid4() for _ in range(count)]
    data = [random_block(store.layout, 500 + i) for i in range(count)]
    checksums = [store.put(key, d, tier=tier).checksum.hex for key, d in zip(keys, data, strict=True)]
    blocks = make_blocks(count, tier=tier, node=None if tier == "remote" else "gpu-0", keys=keys, checksums=checksums)
    return list(zip(blocks, [d.clone() for d in data], strict=True))


def _tallies() -> dict[tuple[str, str, str, str], tuple[int, int]]:
    return {(t.kind, t.src_tier, t.reason, t.result): (t.blocks, t.bytes) for t in MovementTally.objects.all()}


def test_a_stale_epoch_in_the_middle_of_a_wave_is_refused_for_that_movement_only(node, store, make_blocks, monkeypatch):
    monkeypatch.setattr(glue, "WAVE_BYTES", 8 * B)  # the five moves are one wave
    made = _blocks(store, make_blocks, "host", 5)
    blocks = [block for block, _ in made]
    ids = _record(blocks, MovementKind.MOVE, "disk")
    stale_at_start, stale_at_flip = blocks[1], blocks[3]
    placement_mark_corrupt(placement_id=Placement.objects.get(block=stale_at_start).id)  # changed since planning
    rival = Placement.objects.get(block=stale_at_flip)
    real_flip = glue.placements_flip_many

    def flip_after_a_rival(**kwargs):  # type: ignore[no-untyped-def]
        # Between this wave's copy and its flip, someone else changes one source (a re-registration).
        assert len(kwargs["flips"]) == 4
        Placement.objects.filter(id=rival.id).update(epoch=rival.epoch + 5)
        return real_flip(**kwargs)

    monkeypatch.setattr(glue, "placements_flip_many", flip_after_a_rival)
    outcomes = MovementExecutor(node="gpu-0", store=store).run("move", ids)

    states = {o.movement_id: o.state for o in outcomes}
    for (block, original), ident in zip(made, ids, strict=True):
        movement = Movement.objects.get(id=ident)
        assert (movement.attempts, movement.reason, movement.policy_version) == (1, "manual", 3)
        assert movement.duration_s is not None and movement.finished_at is not None
        if block == stale_at_start:
            assert states[ident] == movement.state == MovementState.CANCELLED
            assert "changed since planning" in movement.detail
            assert placements(block) == {("host", "gpu-0"): PlacementState.CORRUPT}
        elif block == stale_at_flip:
            assert states[ident] == movement.state == MovementState.CANCELLED
            assert "flip refused" in movement.detail
            assert placements(block) == {("host", "gpu-0"): PlacementState.READY}  # its target dropped
            assert store.contains(block.prefix_key) == ("host",)
            assert torch.equal(read_block(store, block, "host"), original)
        else:
            assert states[ident] == movement.state == MovementState.DONE
            assert movement.bytes == B and movement.error == ""
            assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}
            assert store.contains(block.prefix_key) == ("disk",)
            assert torch.equal(read_block(store, block, "disk"), original)
            assert Placement.objects.get(block=block).checksum == store.tier("disk").checksum(block.prefix_key).hex
    assert _tallies() == {
        ("move", "host", "manual", "done"): (3, 3 * B),
        ("move", "host", "manual", "cancelled"): (2, 0),
    }
    report = invariants_check(stores={"gpu-0": store})
    assert report.ok, report.violations


def test_a_wave_with_failing_copies_finishes_the_others(node, store, make_blocks, monkeypatch):
    monkeypatch.setattr(glue, "WAVE_BYTES", 8 * B)  # the six moves are one wave
    made = _blocks(store, make_blocks, "disk", 6)
    blocks = [block for block, _ in made]
    ids = _record(blocks, MovementKind.MOVE, "remote")
    corrupt, vanished = blocks[1], blocks[4]
    flip_a_data_byte(store.tier("disk").path_of(corrupt.prefix_key))
    os.unlink(store.tier("disk").path_of(vanished.prefix_key))

    outcomes = MovementExecutor(node="gpu-0", store=store).run("move", ids)

    assert [o.movement_id for o in outcomes] == ids
    for (block, original), outcome in zip(made, outcomes, strict=True):
        movement = Movement.objects.get(id=outcome.movement_id)
        assert outcome.state == movement.state
        if block in (corrupt, vanished):
            assert movement.state == MovementState.FAILED and "quarantined" in movement.error
            assert placements(block) == {("disk", "gpu-0"): PlacementState.CORRUPT}
            assert store.contains(block.prefix_key) == ()
        else:
            assert movement.state == MovementState.DONE
            assert placements(block) == {("remote", ""): PlacementState.READY}
            assert torch.equal(read_block(store, block, "remote"), original)
    assert _tallies() == {
        ("move", "disk", "manual", "done"): (4, 4 * B),
        ("move", "disk", "manual", "failed"): (2, 0),
        ("scrub", "disk", "move", "corrupt"): (2, 0),
    }
    assert invariants_check(stores={"gpu-0": store}).ok


@pytest.mark.parametrize("kind, src, dst", [("move", "host", "disk"), ("warm", "remote", "host")])
def test_a_wave_costs_the_same_few_statements_whatever_its_size(node, store, make_blocks, monkeypatch, kind, src, dst):
    executor = MovementExecutor(node="gpu-0", store=store)
    counts = {}
    for size in (2, 8):
        monkeypatch.setattr(glue, "WAVE_BYTES", size * B)  # one wave of `size` movements
        ids = _record([block for block, _ in _blocks(store, make_blocks, src, size)], kind, dst)
        with CaptureQueriesContext(connection) as queries:
            outcomes = executor.run(kind, ids)
        assert {o.state for o in outcomes} == {MovementState.DONE}
        counts[size] = len(queries)
    assert counts[8] == counts[2] <= QUERIES_PER_WAVE, counts


def test_resumed_finished_and_fresh_movements_share_a_wave_and_a_retry_changes_nothing(
    node, store, make_blocks, monkeypatch
):
    monkeypatch.setattr(glue, "WAVE_BYTES", 8 * B)
    made = _blocks(store, make_blocks, "host", 4)
    blocks = [block for block, _ in made]
    fresh, before_flip, after_flip, finished = _record(blocks, MovementKind.MOVE, "disk")
    # An earlier attempt reserved a target and died before writing it.
    movement_start(movement_id=before_flip, node="gpu-0")
    stale = placement_create_pending(block_id=blocks[1].id, tier="disk", node="gpu-0", size_bytes=B)
    movement_set_target(movement_id=before_flip, placement_id=stale.id)
    # An earlier attempt copied and flipped, and died before freeing the source.
    movement_start(movement_id=after_flip, node="gpu-0")
    source = Placement.objects.get(block=blocks[2])
    target = placement_create_pending(block_id=blocks[2].id, tier="disk", node="gpu-0", size_bytes=B)
    movement_set_target(movement_id=after_flip, placement_id=target.id)
    checksum = store.tier("disk").put(blocks[2].prefix_key, made[2][1]).checksum.hex
    placement_flip(source_id=source.id, source_epoch=1, target_id=target.id, target_epoch=1, checksum=checksum)
    # A duplicate delivery finished this one already.
    movement_start(movement_id=finished, node="gpu-0")
    movement_finish(movement_id=finished, state=MovementState.CANCELLED, detail="finished elsewhere")

    executor = MovementExecutor(node="gpu-0", store=store)
    outcomes = executor.run("move", [fresh, before_flip, after_flip, finished])

    assert [o.state for o in outcomes] == ["done", "done", "done", "skipped"]
    assert Movement.objects.get(id=after_flip).detail == "resumed after the flip"
    taken_over = Placement.objects.get(id=stale.id)
    assert (taken_over.state, taken_over.epoch > stale.epoch) == (PlacementState.READY, True)
    for block, original in made[:3]:
        assert placements(block) == {("disk", "gpu-0"): PlacementState.READY}
        assert store.contains(block.prefix_key) == ("disk",)
        assert torch.equal(read_block(store, block, "disk"), original)
    assert placements(blocks[3]) == {("host", "gpu-0"): PlacementState.READY}
    assert {m.id: m.attempts for m in Movement.objects.filter(id__in=[fresh, before_flip, after_flip])} == {
        fresh: 1,
        before_flip: 2,
        after_flip: 2,
    }
    tallies = _tallies()
    assert tallies[("move", "host", "manual", "done")] == (3, 3 * B)

    # The same batch delivered again: every movement is finished, nothing changes.
    again = executor.run("move", [fresh, before_flip, after_flip, finished])
    assert {o.state for o in again} == {"skipped"}
    assert _tallies() == tallies
    assert invariants_check(stores={"gpu-0": store}).ok


def test_start_many_refuses_another_nodes_movement_and_skips_finished_ones(node, make_blocks):
    blocks = make_blocks(3)
    ours = _record(blocks[:2], MovementKind.MOVE, "disk")
    theirs = _record(blocks[2:], MovementKind.MOVE, "disk", exec_node="gpu-9")
    movement_start(movement_id=ours[1], node="gpu-0")
    movement_finish(movement_id=ours[1], state=MovementState.DONE, nbytes=B)
    with pytest.raises(MovementError, match="belongs to node 'gpu-9', not 'gpu-0'") as info:
        movements_start_many(movement_ids=[ours[0], theirs[0]], node="gpu-0")
    assert info.value.field == "node"
    assert Movement.objects.get(id=ours[0]).attempts == 0  # the refused call changed nothing
    started = movements_start_many(movement_ids=[ours[0], ours[1], 999_999], node="gpu-0")
    assert started[1:] == [None, None]
    assert started[0] is not None and (started[0].state, started[0].attempts) == (MovementState.RUNNING, 1)
    assert Movement.objects.get(id=ours[0]).state == MovementState.RUNNING


def test_finish_many_records_and_tallies_each_result_once(node, make_blocks, django_assert_num_queries):
    ids = _record(make_blocks(4), MovementKind.MOVE, "disk")
    movements_start_many(movement_ids=ids, node="gpu-0")
    results = [
        MovementResult(movement_id=ids[0], state=MovementState.DONE, nbytes=B, duration_s=0.5),
        MovementResult(movement_id=ids[1], state=MovementState.DONE, nbytes=B, duration_s=0.25),
        MovementResult(movement_id=ids[2], state=MovementState.FAILED, duration_s=0.1, error="tier disk is full"),
        MovementResult(movement_id=ids[3], state=MovementState.CANCELLED, detail="the copy changed"),
    ]
    with django_assert_num_queries(1):  # record and tally: one statement
        finished = movements_finish_many(results=results)
    assert [m.state for m in finished if m is not None] == ["done", "done", "failed", "cancelled"]
    rows = {m.id: m for m in Movement.objects.filter(id__in=ids)}
    assert (rows[ids[0]].bytes, rows[ids[0]].duration_s, rows[ids[0]].policy_version) == (B, 0.5, 3)
    assert (rows[ids[2]].error, rows[ids[2]].detail) == ("tier disk is full", "")
    assert rows[ids[3]].detail == "the copy changed" and rows[ids[3]].duration_s is None
    assert all(m.finished_at is not None for m in rows.values())
    expected = {
        ("move", "host", "manual", "done"): (2, 2 * B),
        ("move", "host", "manual", "failed"): (1, 0),
        ("move", "host", "manual", "cancelled"): (1, 0),
    }
    assert _tallies() == expected
    # Finishing again (a duplicate delivery) changes nothing, not even a tally.
    assert movements_finish_many(results=results[:2]) == [None, None]
    assert _tallies() == expected
    with pytest.raises(MovementError, match="a movement finishes as") as info:
        movements_finish_many(results=[results[0], MovementResult(movement_id=ids[1], state="running")])
    assert info.value.field == "results[1].state"
    with pytest.raises(MovementError, match="named twice"):
        movements_finish_many(results=[results[0], results[0]])
