"""Registration, touches, placement lifecycle with the epoch guard, purges, namespaces and profiles."""

from __future__ import annotations

import time
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.directory import queries
from controlplane.directory.errors import (
    DirectoryError,
    InUse,
    InvalidTransition,
    PlacementNotFound,
    StaleEpoch,
    UnknownNamespace,
    UnknownNode,
)
from controlplane.directory.models import Block, ModelProfile, Namespace, Placement
from controlplane.directory.selectors import blocks_lookup
from controlplane.directory.services import (
    PlacementFlip,
    blocks_purge,
    blocks_register,
    blocks_touch,
    modelprofile_create,
    modelprofile_delete,
    namespace_create,
    namespace_delete,
    placement_create_pending,
    placement_delete,
    placement_flip,
    placement_mark_corrupt,
    placement_mark_deleting,
    placement_mark_ready,
    placements_change,
    placements_flip_many,
)
from worker.dataplane.directory import BlockRegistration, BlockTouch, PlacementChange
from worker.dataplane.profile import ModelProfile as LayoutProfile
from worker.dataplane.profile import model_key as dataplane_model_key

pytestmark = pytest.mark.django_db

CHECKSUM = "ab" * 16


def test_model_profile_key_is_the_data_planes(profile):
    expected = dataplane_model_key(
        LayoutProfile(model_id="strata/tiny-llama", layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
    )
    assert profile.model_key == expected
    assert profile.block_bytes == 2 * 2 * 16 * 2 * 16 * 2


def test_model_profile_refuses_a_duplicate_layout_and_bad_fields(profile):
    with pytest.raises(DirectoryError, match="profile 'tiny-llama' has the same model and layout") as info:
        modelprofile_create(
            name="again", model_id="strata/tiny-llama", layers=2, kv_heads=2, head_dim=16, dtype="fp16", block_tokens=16
        )
    assert info.value.field == "non_field_errors"
    with pytest.raises(DirectoryError, match="layers") as info:
        modelprofile_create(name="bad", model_id="m", layers=0, kv_heads=2, head_dim=16)
    assert info.value.field == "layers"
    with pytest.raises(DirectoryError, match="dtype") as info:
        modelprofile_create(name="bad", model_id="m", layers=1, kv_heads=2, head_dim=16, dtype="int3")
    assert info.value.field == "dtype"
    assert ModelProfile.objects.count() == 1


def test_namespace_salts_are_random_and_namespaces_in_use_are_kept(registration, namespace):
    other = namespace_create(name="fresh")
    assert len(other.salt) == 32 and other.salt != namespace.salt
    blocks_register(registrations=[registration()])
    with pytest.raises(InUse, match="purge them first"):
        namespace_delete(namespace=namespace)
    with pytest.raises(InUse):
        modelprofile_delete(profile=ModelProfile.objects.get())
    namespace_delete(namespace=other)
    assert not Namespace.objects.filter(name="fresh").exists()


def test_register_is_idempotent_and_bumps_the_epoch_only_on_change(registration, profile):
    regs = [registration(position=16 * i) for i in range(3)]
    first = blocks_register(registrations=regs)
    assert (first.blocks, first.placements) == (3, 3)
    again = blocks_register(registrations=regs)
    assert (again.blocks, again.placements) == (0, 0)
    assert set(Placement.objects.values_list("epoch", flat=True)) == {1}
    moved = BlockRegistration(**{**_fields(regs[0]), "locator": "slot:9", "checksum": CHECKSUM})
    changed = blocks_register(registrations=[moved])
    assert (changed.blocks, changed.placements) == (0, 1)
    placement = Placement.objects.get(block__prefix_key=regs[0].prefix_key)
    assert (placement.locator, placement.checksum, placement.epoch) == ("slot:9", CHECKSUM, 2)
    assert Block.objects.count() == 3 and Placement.objects.count() == 3


def test_any_locator_text_round_trips(registration, profile):
    odd = "a\"b\\c,{d} NULL 'q' é/\t"
    reg = registration(locator=odd)
    blocks_register(registrations=[reg])
    assert Placement.objects.get().locator == odd
    loc = blocks_lookup(namespace="tenant-a", model_key=profile.model_key, node="gpu-0", prefix_keys=[reg.prefix_key])
    assert loc.prefix[0].locator == odd


def test_register_duplicates_in_one_batch_keep_the_last(registration):
    reg = registration(locator="first")
    blocks_register(registrations=[reg, BlockRegistration(**{**_fields(reg), "locator": "last"})])
    assert list(Placement.objects.values_list("locator", flat=True)) == ["last"]


def test_register_is_all_or_nothing(registration):
    good = registration()
    with pytest.raises(UnknownNode, match="node: no node named 'gpu-7'"):
        blocks_register(registrations=[good, registration(node="gpu-7")])
    with pytest.raises(UnknownNamespace):
        blocks_register(registrations=[good, registration(namespace="nope")])
    assert not Block.objects.exists() and not Placement.objects.exists()


def test_registration_refuses_bad_values_naming_the_field(registration):
    for overrides, field in [
        (dict(tier="gpu"), "tier"),
        (dict(tier="host", node=None), "node"),
        (dict(tier="remote", node="gpu-0"), "node"),
        (dict(nbytes=-1), "nbytes"),
        (dict(position=-16), "position"),
        (dict(tokens=0), "tokens"),
        (dict(checksum="xyz"), "checksum"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            registration(**overrides)


def test_touch_sums_hits_and_keeps_the_latest_time(registration, profile):
    reg = registration()
    blocks_register(registrations=[reg])
    now = time.time()
    touches = [
        BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=reg.prefix_key, hits=2, at=now - 10),
        BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=reg.prefix_key, hits=3, at=now + 60),
        BlockTouch(namespace="tenant-a", model_key=profile.model_key, prefix_key=uuid.uuid4(), hits=1, at=now),
        BlockTouch(namespace="tenant-b", model_key=profile.model_key, prefix_key=reg.prefix_key, hits=1, at=now),
    ]
    assert blocks_touch(touches=touches) == 1
    block = Block.objects.get()
    assert block.access_count == 5
    assert abs(block.last_access_at.timestamp() - (now + 60)) < 0.01


def _ready_copy(registration, **overrides):
    reg = registration(**overrides)
    blocks_register(registrations=[reg])
    return Placement.objects.get(block__prefix_key=reg.prefix_key, tier=reg.tier)


def test_move_pending_ready_flip_and_free(registration, profile):
    source = _ready_copy(registration)
    target = placement_create_pending(
        block_id=source.block_id, tier="remote", node=None, size_bytes=source.size_bytes, locator="strata:x"
    )
    assert (target.state, target.epoch) == ("pending", 1)
    key = source.block.prefix_key
    ask = dict(namespace="tenant-a", model_key=profile.model_key, node="gpu-1", prefix_keys=[key])
    assert blocks_lookup(**ask).prefix == (None,)  # pending copies are never served
    source_after, target_after = placement_flip(
        source_id=source.id, source_epoch=1, target_id=target.id, target_epoch=1, checksum=CHECKSUM
    )
    assert (source_after.state, source_after.epoch) == ("deleting", 2)
    assert (target_after.state, target_after.epoch, target_after.checksum) == ("ready", 2, CHECKSUM)
    loc = blocks_lookup(**ask).prefix[0]
    assert loc is not None and (loc.tier, loc.epoch) == ("remote", 2)
    placement_delete(placement_id=source.id, epoch=2)
    assert list(Placement.objects.values_list("tier", flat=True)) == ["remote"]


def test_stale_epoch_is_refused_and_changes_nothing(registration):
    source = _ready_copy(registration)
    target = placement_create_pending(block_id=source.block_id, tier="remote", node=None, size_bytes=1)
    placement_mark_corrupt(placement_id=source.id)  # someone else changed the source: epoch 2
    with pytest.raises(StaleEpoch, match=f"placement {source.id} is at epoch 2, not 1") as info:
        placement_flip(source_id=source.id, source_epoch=1, target_id=target.id, target_epoch=1, checksum=CHECKSUM)
    assert (info.value.expected, info.value.actual, info.value.field) == (1, 2, "epoch")
    target.refresh_from_db()
    assert (target.state, target.epoch) == ("pending", 1)
    with pytest.raises(StaleEpoch):
        placement_mark_ready(placement_id=target.id, epoch=7, checksum=CHECKSUM)
    with pytest.raises(StaleEpoch):
        placement_mark_deleting(placement_id=source.id, epoch=1)
    with pytest.raises(StaleEpoch):
        placement_delete(placement_id=source.id, epoch=1)


def test_transitions_from_the_wrong_state_are_refused(registration):
    ready = _ready_copy(registration)
    with pytest.raises(InvalidTransition, match="mark ready needs pending"):
        placement_mark_ready(placement_id=ready.id, epoch=1, checksum=CHECKSUM)
    with pytest.raises(InvalidTransition, match="needs corrupt or deleting"):
        placement_create_pending(block_id=ready.block_id, tier="host", node="gpu-0", size_bytes=1)
    with pytest.raises(InvalidTransition):
        placement_delete(placement_id=ready.id, epoch=1)
    other = _ready_copy(registration, tier="remote", node=None)
    with pytest.raises(DirectoryError, match="different blocks"):
        placement_flip(source_id=ready.id, source_epoch=1, target_id=other.id, target_epoch=1, checksum=CHECKSUM)


def test_flip_many_flips_moves_and_warms_and_refuses_stale_ones_alone(registration, django_assert_max_num_queries):
    moved = _ready_copy(registration)
    warmed = _ready_copy(registration, tier="remote", node=None)
    stale = _ready_copy(registration)
    targets = {
        p.id: placement_create_pending(block_id=p.block_id, tier=tier, node=node, size_bytes=1)
        for p, tier, node in ((moved, "remote", None), (warmed, "host", "gpu-0"), (stale, "remote", None))
    }
    placement_mark_corrupt(placement_id=stale.id)  # someone else changed this source: epoch 2
    flips = [
        PlacementFlip(
            target_id=targets[moved.id].id, target_epoch=1, checksum=CHECKSUM, source_id=moved.id, source_epoch=1
        ),
        PlacementFlip(target_id=targets[warmed.id].id, target_epoch=1, checksum=CHECKSUM),
        PlacementFlip(
            target_id=targets[stale.id].id, target_epoch=1, checksum=CHECKSUM, source_id=stale.id, source_epoch=1
        ),
        PlacementFlip(target_id=999_999, target_epoch=1, checksum=CHECKSUM),
    ]
    with django_assert_max_num_queries(4):  # savepoint, one locking read, one update, release
        outcomes = placements_flip_many(flips=flips)
    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], StaleEpoch) and outcomes[2].field == "epoch"
    assert isinstance(outcomes[3], PlacementNotFound) and "999999" in str(outcomes[3])
    state = {p.id: (p.state, p.epoch, p.checksum) for p in Placement.objects.all()}
    assert state[moved.id][:2] == ("deleting", 2)
    assert state[targets[moved.id].id] == ("ready", 2, CHECKSUM)
    assert state[warmed.id][:2] == ("ready", 1)  # a warm-up leaves its source alone
    assert state[targets[warmed.id].id] == ("ready", 2, CHECKSUM)
    assert state[stale.id][:2] == ("corrupt", 2)
    assert state[targets[stale.id].id] == ("pending", 1, "")
    # Within one call the flips see each other: flipping the same target again is refused.
    [again] = placements_flip_many(flips=flips[1:2])
    assert isinstance(again, StaleEpoch)


def test_flip_many_refuses_malformed_input_naming_the_field_and_changes_nothing(registration):
    source = _ready_copy(registration)
    target = placement_create_pending(block_id=source.block_id, tier="remote", node=None, size_bytes=1)
    good = PlacementFlip(target_id=target.id, target_epoch=1, checksum=CHECKSUM, source_id=source.id, source_epoch=1)
    for bad, field in (
        (PlacementFlip(target_id=target.id, target_epoch=1, checksum="XYZ"), "flips[1].checksum"),
        (
            PlacementFlip(target_id=source.id, target_epoch=1, checksum=CHECKSUM, source_id=source.id, source_epoch=1),
            "flips[1].target_id",
        ),
        (
            PlacementFlip(target_id=target.id, target_epoch=1, checksum=CHECKSUM, source_id=source.id),
            "flips[1].source_epoch",
        ),
    ):
        with pytest.raises(DirectoryError, match=field.replace("[", r"\[").replace("]", r"\]")) as info:
            placements_flip_many(flips=[good, bad])
        assert info.value.field == field
    assert {(p.id, p.state, p.epoch) for p in Placement.objects.all()} == {
        (source.id, "ready", 1),
        (target.id, "pending", 1),
    }
    other = _ready_copy(registration, tier="remote", node=None)
    [mismatch] = placements_flip_many(
        flips=[
            PlacementFlip(target_id=other.id, target_epoch=1, checksum=CHECKSUM, source_id=source.id, source_epoch=1)
        ]
    )
    assert isinstance(mismatch, DirectoryError) and "different blocks" in str(mismatch)


def test_a_corrupt_copy_can_be_rewritten(registration):
    copy = _ready_copy(registration)
    placement_mark_corrupt(placement_id=copy.id, epoch=1)
    again = placement_create_pending(block_id=copy.block_id, tier="host", node="gpu-0", size_bytes=5, locator="new")
    assert (again.id, again.state, again.epoch, again.locator) == (copy.id, "pending", 3, "new")
    ready = placement_mark_ready(placement_id=again.id, epoch=3, checksum=CHECKSUM, size_bytes=6)
    assert (ready.state, ready.epoch, ready.size_bytes) == ("ready", 4, 6)


def test_changes_by_key_respect_the_epoch(registration, profile):
    copy = _ready_copy(registration)
    key = copy.block.prefix_key
    ref = dict(namespace="tenant-a", model_key=profile.model_key, prefix_key=key, tier="host", node="gpu-0")
    assert placements_change(changes=[PlacementChange(**ref, action="corrupt", expected_epoch=5)]) == 0
    assert placements_change(changes=[PlacementChange(**ref, action="corrupt", expected_epoch=1)]) == 1
    copy.refresh_from_db()
    assert (copy.state, copy.epoch) == ("corrupt", 2)
    assert (
        placements_change(
            changes=[
                PlacementChange(**ref, action="deleting"),
                PlacementChange(**ref, action="delete", expected_epoch=3),
            ]
        )
        == 2
    )
    assert not Placement.objects.exists()


def test_purge_by_namespace_and_model(registration, profile, other_namespace):
    other_profile = modelprofile_create(name="other", model_id="strata/other", layers=1, kv_heads=1, head_dim=8)
    blocks_register(
        registrations=[registration() for _ in range(3)]
        + [registration(model_key=other_profile.model_key)]
        + [registration(namespace="tenant-b")]
    )
    counts = blocks_purge(namespace="tenant-a", model="tiny-llama")
    assert (counts.blocks, counts.placements) == (3, 3)
    assert blocks_purge(namespace="tenant-a").blocks == 1
    assert list(Block.objects.values_list("namespace__name", flat=True)) == ["tenant-b"]
    with pytest.raises(UnknownNamespace):
        blocks_purge(namespace="nope")


def test_every_hot_statement_is_an_index_scan(registration, profile, node):
    """At scale the planner must walk indexes; 20K rows are enough for it to prefer them."""
    regs = [registration(position=16 * (i % 64)) for i in range(20000)]
    for start in range(0, len(regs), 4096):
        blocks_register(registrations=regs[start : start + 4096])
    now = timezone.now()
    fresh = [registration() for _ in range(64)]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE directory_block; ANALYZE directory_placement")
        scope = queries.resolve(cursor, namespaces=["tenant-a"], model_keys=[profile.model_key], nodes=["gpu-0"])
        register_rows, _ = queries.registration_rows(scope, fresh)
        register_params = queries.register_params(register_rows, now)
        touches = [
            queries.TouchRow(namespace="tenant-a", model_key=profile.model_key, prefix_key=r.prefix_key, hits=1, at=now)
            for r in regs[:64]
        ]
        changes = [
            queries.ChangeRow(
                namespace="tenant-a",
                model_key=profile.model_key,
                prefix_key=r.prefix_key,
                tier="host",
                node="gpu-0",
                expected_epoch=1,
            )
            for r in regs[100:164]
        ]
        plans = {
            "lookup": queries.explain(
                cursor,
                queries.LOOKUP_SQL,
                queries.lookup_params(
                    namespace="tenant-a",
                    model_key=profile.model_key,
                    node="gpu-0",
                    prefix_keys=[r.prefix_key for r in regs[:64]],
                    content_keys=[r.content_key for r in regs[64:72]],
                ),
            ),
            "register blocks": queries.explain(cursor, queries.REGISTER_BLOCKS_SQL, register_params),
            "register placements": queries.explain(cursor, queries.REGISTER_PLACEMENTS_SQL, register_params),
            "touch": queries.explain(cursor, queries.TOUCH_SQL, queries.touch_params(touches)),
            "change": queries.explain(
                cursor, queries.CHANGE_STATE_SQL, queries.change_params(changes, action="corrupt", now=now)
            ),
        }
    for name, plan in plans.items():
        print(f"--- {name}\n{plan}")
        assert "Seq Scan on directory_block" not in plan, name
        assert "Seq Scan on directory_placement" not in plan, name
    assert "block_prefix_uniq" in plans["lookup"] and "block_content_hash" in plans["lookup"]
    assert "placement_block_tier_node_uniq" in plans["lookup"]
    assert "block_prefix_uniq" in plans["register placements"]
    assert "Tuples Inserted: 64" in plans["register placements"]
    assert "block_prefix_uniq" in plans["touch"] and "directory_block_pkey" in plans["touch"]


def _fields(reg: BlockRegistration) -> dict[str, object]:
    return {name: getattr(reg, name) for name in BlockRegistration.__dataclass_fields__}


def test_ensure_services_are_idempotent():
    """What a node calls before serving: its namespaces and the profile of its model."""
    from controlplane.directory.services import modelprofile_ensure, namespace_ensure

    first = namespace_ensure(name="default")
    assert namespace_ensure(name="default").salt == first.salt
    layout = LayoutProfile(
        model_id="strata/node-model", layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16
    )
    created = modelprofile_ensure(profile=layout)
    assert created.model_key == dataplane_model_key(layout)
    assert modelprofile_ensure(profile=layout).pk == created.pk
    assert ModelProfile.objects.filter(model_key=created.model_key).count() == 1
