"""The bulk placement services a node's wave of movements uses: reserving many pending copies and
forgetting many freed ones, each copy judged as its single form would judge it, in one statement."""

from __future__ import annotations

import pytest

from controlplane.directory.errors import DirectoryError, InvalidTransition
from controlplane.directory.models import Block, Placement
from controlplane.directory.services import (
    PendingCopy,
    blocks_register,
    placement_create_pending,
    placement_mark_corrupt,
    placement_mark_deleting,
    placements_create_pending_many,
    placements_delete_many,
)

pytestmark = pytest.mark.django_db


def _ready_copy(registration, **overrides):  # type: ignore[no-untyped-def]
    reg = registration(**overrides)
    blocks_register(registrations=[reg])
    return Placement.objects.get(block__prefix_key=reg.prefix_key, tier=reg.tier)


def test_create_pending_many_reserves_new_and_reusable_copies_and_refuses_the_others_alone(
    registration, django_assert_num_queries
):
    fresh = _ready_copy(registration)
    corrupt = _ready_copy(registration)
    corrupt_target = placement_create_pending(block_id=corrupt.block_id, tier="remote", node=None, size_bytes=1)
    placement_mark_corrupt(placement_id=corrupt_target.id)  # epoch 2: reusable, as a new pending copy at 3
    taken = _ready_copy(registration)
    taken_target = placement_create_pending(block_id=taken.block_id, tier="remote", node=None, size_bytes=1)
    gone = _ready_copy(registration)
    Block.objects.filter(id=gone.block_id).delete()
    copies = [
        PendingCopy(block_id=fresh.block_id, tier="remote", node=None, size_bytes=10),
        PendingCopy(block_id=corrupt.block_id, tier="remote", node=None, size_bytes=10),
        PendingCopy(block_id=fresh.block_id, tier="disk", node="gpu-0", size_bytes=10),
    ]

    with django_assert_num_queries(2):  # the node names, the insert (no savepoint of its own)
        new_remote, reused, new_disk = placements_create_pending_many(copies=copies)
    assert isinstance(new_remote, Placement) and (new_remote.state, new_remote.epoch, new_remote.size_bytes) == (
        "pending",
        1,
        10,
    )
    assert new_remote.node_id is None and new_remote.block_id == fresh.block_id
    assert isinstance(reused, Placement) and (reused.id, reused.state, reused.epoch) == (
        corrupt_target.id,
        "pending",
        3,
    )
    assert isinstance(new_disk, Placement) and new_disk.node_id == fresh.node_id and new_disk.tier == "disk"
    for answer in (new_remote, reused, new_disk):
        stored = Placement.objects.get(id=answer.id)
        assert (stored.state, stored.epoch, stored.checksum, stored.size_bytes) == ("pending", answer.epoch, "", 10)

    # Copies that cannot be reserved are refused each on its own; the others in the call go on.
    another = _ready_copy(registration)
    refused, missing, reserved = placements_create_pending_many(
        copies=[
            PendingCopy(block_id=taken.block_id, tier="remote", node=None, size_bytes=10),
            PendingCopy(block_id=gone.block_id, tier="remote", node=None, size_bytes=10),
            PendingCopy(block_id=another.block_id, tier="remote", node=None, size_bytes=10),
        ]
    )
    assert isinstance(refused, InvalidTransition) and f"placement {taken_target.id} is pending" in str(refused)
    taken_target.refresh_from_db()
    assert (taken_target.state, taken_target.epoch) == ("pending", 1)  # another movement's target: untouched
    assert type(missing) is DirectoryError and missing.field == "block" and f"no block {gone.block_id}" in str(missing)
    assert isinstance(reserved, Placement) and reserved.block_id == another.block_id
    # Asked again, a copy just reserved is pending: refused, as the single form refuses it.
    [again] = placements_create_pending_many(copies=copies[:1])
    assert isinstance(again, InvalidTransition)
    with pytest.raises(InvalidTransition):
        placement_create_pending(block_id=fresh.block_id, tier="remote", node=None, size_bytes=10)


def test_create_pending_many_refuses_malformed_input_naming_the_field_and_changes_nothing(registration):
    source = _ready_copy(registration)
    good = PendingCopy(block_id=source.block_id, tier="remote", node=None, size_bytes=1)
    for bad, field, error in (
        (PendingCopy(block_id=source.block_id, tier="tape", node=None, size_bytes=1), "copies[1].tier", DirectoryError),
        (
            PendingCopy(block_id=source.block_id, tier="remote", node="gpu-0", size_bytes=1),
            "copies[1].node",
            DirectoryError,
        ),
        (PendingCopy(block_id=source.block_id, tier="disk", node=None, size_bytes=1), "copies[1].node", DirectoryError),
        (
            PendingCopy(block_id=source.block_id, tier="disk", node="gpu-9", size_bytes=1),
            "copies[1].node",
            DirectoryError,
        ),
        (
            PendingCopy(block_id=source.block_id, tier="disk", node="gpu-0", size_bytes=-1),
            "copies[1].size_bytes",
            DirectoryError,
        ),
        (good, "copies[1].block_id", DirectoryError),
    ):
        with pytest.raises(error) as info:
            placements_create_pending_many(copies=[good, bad])
        assert info.value.field == field, info.value
    with pytest.raises(DirectoryError, match=r"copies\[0\]\.node: no node named 'gpu-9'"):
        placements_create_pending_many(
            copies=[PendingCopy(block_id=source.block_id, tier="disk", node="gpu-9", size_bytes=1)]
        )
    assert list(Placement.objects.values_list("id", flat=True)) == [source.id]
    assert placements_create_pending_many(copies=[]) == []


def test_delete_many_forgets_freed_copies_at_their_epoch_and_leaves_changed_ones(
    registration, django_assert_num_queries
):
    freed = [placement_mark_deleting(placement_id=_ready_copy(registration).id, epoch=1) for _ in range(3)]
    corrupt = placement_mark_corrupt(placement_id=_ready_copy(registration).id)
    ready = _ready_copy(registration)
    moved_on = freed[2]
    Placement.objects.filter(id=moved_on.id).update(epoch=moved_on.epoch + 1)  # someone re-registered it
    asked = [(p.id, p.epoch) for p in freed] + [(corrupt.id, corrupt.epoch), (ready.id, ready.epoch), (999_999, 1)]
    with django_assert_num_queries(1):
        deleted = placements_delete_many(placements=asked)
    assert deleted == {freed[0].id, freed[1].id, corrupt.id}
    assert set(Placement.objects.values_list("id", flat=True)) == {moved_on.id, ready.id}
    assert placements_delete_many(placements=asked) == set()  # twice: nothing more
    assert placements_delete_many(placements=[]) == set()
