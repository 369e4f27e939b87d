"""Storage faults under real node processes: a disk tier that fills up (its capacity option, and a
real filesystem that runs out of space), and block files that are corrupted, truncated or swapped,
found by the node's scrub task (sent through the broker) and by reads (the engine's, the store's
and a move's). After each: reconcile, I1-I4, and nothing corrupt was ever served."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from django.test import Client

from controlplane.directory.choices import PlacementState
from controlplane.directory.models import Block, Node, Placement
from controlplane.movements.choices import MovementState
from controlplane.movements.models import Movement, MovementTally
from controlplane.movements.services import movements_plan
from controlplane.movements.tasks import movements_reconcile_nodes_task, movements_scrub_nodes_task
from controlplane.policies.snapshot import PolicySnapshot, TierPolicySpec
from tests.movements.procs import (
    DRAIN_HOST,
    blocks_of,
    reconcile_and_check,
    served_bytes_check,
    state_of,
    write_blocks,
)
from tests.support import wait_for
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.disk import block_file_bytes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

# The tiny preset's block at 16 tokens: 2 layers x K,V x 16 tokens x 2 KV heads x 16 dims, float32.
TINY_LAYOUT = BlockLayout(layers=2, kv_heads=2, head_dim=16, block_tokens=16, dtype="float32")
DISK_FILE_BYTES = block_file_bytes(TINY_LAYOUT)

DRAIN_DISK = PolicySnapshot(
    version=2,
    mode="",
    classes=(),
    tiers=(TierPolicySpec(tier="disk", capacity_bytes=1, high_watermark=0.9, low_watermark=0.5),),
)


def _all_finished(ids: list[int]) -> bool:
    return all(state_of(i) in (MovementState.DONE, MovementState.FAILED, MovementState.CANCELLED) for i in ids)


def _copies(key: uuid.UUID) -> dict[str, str]:
    return dict(Placement.objects.filter(block__prefix_key=key).values_list("tier", "state"))


def _failures(found_by: str, tier: str = "disk") -> int:
    row = MovementTally.objects.filter(kind="scrub", src_tier=tier, reason=found_by, result="corrupt").first()
    return row.blocks if row else 0


# -- a full disk tier ------------------------------------------------------------------------------------


def _full_disk_outcome(nodes, store, seeds: dict[uuid.UUID, int]) -> tuple[list[Movement], list[Movement]]:  # type: ignore[no-untyped-def]
    result = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
    assert len(result.written) == len(seeds), result.summary()
    assert {m.route for m in result.movements} == {"host->disk"}
    wait_for(lambda: _all_finished(result.written), timeout=90, what="the moves into the disk tier to finish")
    movements = list(Movement.objects.filter(id__in=result.written).order_by("id"))
    done = [m for m in movements if m.state == MovementState.DONE]
    failed = [m for m in movements if m.state == MovementState.FAILED]
    assert len(done) + len(failed) == len(movements), [(m.state, m.detail) for m in movements]
    for movement in failed:
        assert "tier disk is full" in movement.error, movement.error
        key = Block.objects.get(id=movement.block_id).prefix_key
        # The source stays the served copy; the reserved target is gone, not left pending.
        assert _copies(key) == {"host": PlacementState.READY}
    for movement in done:
        assert _copies(Block.objects.get(id=movement.block_id).prefix_key) == {"disk": PlacementState.READY}
    usage = store.tier("disk").usage()
    assert usage.pending_bytes == 0, usage  # no reservation outlives a failed write
    assert usage.blocks == len(done)
    # Every block is still served with its own bytes: from disk when moved, from host when not.
    assert served_bytes_check(store, seeds) == {"served": len(seeds), "missed": 0}
    tally = MovementTally.objects.get(kind="move", src_tier="host", dst_tier="disk", result="failed")
    assert tally.blocks == len(failed)
    reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(nodes.disk_path) for name in files)
    return done, failed


def test_moves_beyond_the_disk_tiers_capacity_fail_cleanly(node_factory):
    # Room for three and a half block files: the planner (which counts block bytes, not the
    # tier's file headers) sends four, and the fourth finds the tier full.
    nodes = node_factory(tiers="device,host,disk", disk_bytes=str(3 * DISK_FILE_BYTES + DISK_FILE_BYTES // 2))
    process, _ = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        assert store.layout == TINY_LAYOUT and store.tier("disk").file_bytes == DISK_FILE_BYTES
        seeds = write_blocks(store, profile, nodes.name, 4)
        done, failed = _full_disk_outcome(nodes, store, seeds)
        assert (len(done), len(failed)) == (3, 1)
        assert "bytes needed" in failed[0].error
    finally:
        store.close()


@pytest.fixture
def small_filesystem(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a disk tier on it runs out of real space long before its capacity option."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the capacity-option test covers a full tier")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_moves_into_a_filesystem_that_runs_out_of_space_fail_cleanly(small_filesystem, node_factory):
    nodes = node_factory(tiers="device,host,disk", disk_bytes="64MiB", disk_path=small_filesystem / "disk")
    process, _ = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        seeds = write_blocks(store, profile, nodes.name, 8)
        done, failed = _full_disk_outcome(nodes, store, seeds)
        assert done and failed, "64 KiB holds some block files but not eight"
        assert all("No space left on device" in m.error for m in failed), [m.error for m in failed]
    finally:
        store.close()


# -- corrupt, truncated and swapped block files ------------------------------------------------------------


def _damage(store, keys: list[uuid.UUID]) -> dict[str, uuid.UUID]:  # type: ignore[no-untyped-def]
    """Corrupt one byte of the first block's data, truncate the second's file, swap the files of
    the third and fourth. Returns which block got which damage."""
    disk = store.tier("disk")
    corrupt, truncated, swap_a, swap_b = keys[:4]
    with open(disk.path_of(corrupt), "r+b") as f:
        f.seek(disk.header_bytes + 100)
        byte = f.read(1)
        f.seek(disk.header_bytes + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(disk.path_of(truncated), disk.header_bytes + 512)
    parked = disk.path_of(swap_a).with_suffix(".swap")
    os.rename(disk.path_of(swap_a), parked)
    os.rename(disk.path_of(swap_b), disk.path_of(swap_a))
    os.rename(parked, disk.path_of(swap_b))
    return {"corrupt": corrupt, "truncated": truncated, "swapped-a": swap_a, "swapped-b": swap_b}


def test_the_scrub_task_quarantines_corrupt_truncated_and_swapped_files(node_factory):
    nodes = node_factory()
    process, log = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        seeds = write_blocks(store, profile, nodes.name, 6)
        moved = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(moved.written) == len(seeds)
        wait_for(
            lambda: all(state_of(i) == MovementState.DONE for i in moved.written),
            timeout=60,
            what="the blocks to reach the disk tier",
        )
        keys = list(seeds)
        damaged = _damage(store, keys)
        intact = keys[4:]
        # The scrub beat job fans out node.scrub to every up node through the broker.
        assert movements_scrub_nodes_task() == [nodes.name]
        wait_for(
            lambda: all(_copies(k) == {"disk": PlacementState.CORRUPT} for k in damaged.values()),
            timeout=60,
            what="the scrub to quarantine the four damaged copies",
        )
        wait_for(lambda: "scrub of disk on node" in log.read_text(), what="the scrub's report in the node log")
        assert f"scrub of disk on node {nodes.name}: 6 copies checked, 4 quarantined" in log.read_text()
        for key in intact:
            assert _copies(key) == {"disk": PlacementState.READY}
        for key in damaged.values():
            assert not store.tier("disk").contains(key), "a quarantined copy's bytes are dropped"
        assert _failures("scrub") == 4
        metrics = Client().get("/metrics").content.decode()
        assert 'strata_checksum_failures_total{found_by="scrub",tier="disk"} 4.0' in metrics
        # Readers see a miss for the damaged blocks and the exact bytes for the rest.
        assert served_bytes_check(store, seeds) == {"served": 2, "missed": 4}
        reconcile_and_check({nodes.name: store})
    finally:
        store.close()


def test_reads_of_damaged_files_are_misses_never_wrong_tokens(node_factory):
    # No device tier: every cached load of this test reads the node's disk files.
    nodes = node_factory(tiers="host,disk,remote")
    process, log = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{nodes.port}/v1", api_key="unused", max_retries=2, timeout=120)
    try:
        prompt = "Strata keeps KV blocks in tiers and moves them under policies. " * 8
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        expected = (first.usage.prompt_tokens + 3) // 16
        assert expected >= 5
        wait_for(
            lambda: Placement.objects.filter(node__name=nodes.name, tier="host", state="ready").count() == expected,
            what="the write-back's registrations",
        )
        keys = list(Block.objects.order_by("position").values_list("prefix_key", flat=True))
        wait_for(
            lambda: Node.objects.get(name=nodes.name).tiers.filter(tier="host", used_bytes__gt=0).exists(),
            what="the host use in a heartbeat",
        )
        moved = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(moved.written) == expected, moved.summary()
        wait_for(
            lambda: all(state_of(i) == MovementState.DONE for i in moved.written),
            timeout=60,
            what="the blocks to reach the disk tier",
        )
        second = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        assert second.usage.prompt_tokens_details.cached_tokens > 0, "the prompt's blocks load from disk"
        assert second.choices[0].text == first.choices[0].text

        damaged = _damage(store, keys)
        third = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        # The first block is corrupt: its load fails, the engine recomputes, the answer is the same.
        assert third.choices[0].text == first.choices[0].text
        # (The engine may also have chosen to recompute rather than load: either way nothing damaged is served.)
        assert third.usage.prompt_tokens_details.cached_tokens == 0

        # A move reads its source before copying: the damaged copies are quarantined on the spot.
        # (Planned fleet-wide: the shared remote tier is a destination only then.)
        drained = wait_for(
            lambda: movements_plan(snapshot=DRAIN_DISK, reason="manual").written,
            timeout=30,
            what="a plan out of the disk tier (after a heartbeat reports its use)",
        )
        wait_for(lambda: _all_finished(drained), timeout=60, what="the moves out of the disk tier")
        outcomes = {Block.objects.get(id=m.block_id).prefix_key: m for m in Movement.objects.filter(id__in=drained)}
        assert {m.route for m in outcomes.values()} == {"disk->remote"}
        by_move = 0
        for name, key in damaged.items():
            assert _copies(key).get("disk") == PlacementState.CORRUPT, name
            if key == damaged["corrupt"] and key not in outcomes:
                continue  # quarantined by the engine's failed load before the plan: never planned
            if key == damaged["corrupt"] and outcomes[key].state == MovementState.CANCELLED:
                # The engine's load of this block failed its checksum and quarantined the copy
                # itself (write-behind, so after this plan was made): the move found it corrupt.
                assert "now corrupt" in outcomes[key].detail, outcomes[key].detail
                continue
            assert outcomes[key].state == MovementState.FAILED, (name, outcomes[key].detail)
            assert "quarantined" in outcomes[key].error
            by_move += 1
        for key in keys[4:]:
            assert outcomes[key].state == MovementState.DONE
            assert _copies(key).get("remote") == PlacementState.READY
        assert by_move >= 3 and _failures("move") == by_move
        metrics = Client().get("/metrics").content.decode()
        assert f'strata_checksum_failures_total{{found_by="move",tier="disk"}} {float(by_move)}' in metrics

        fourth = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        assert fourth.choices[0].text == first.choices[0].text
        reconcile_and_check({nodes.name: store})
    finally:
        store.close()


def test_a_store_read_and_the_reconcile_task_quarantine_a_damaged_file(node_factory):
    nodes = node_factory(tiers="device,host,disk")
    process, _ = nodes.start()
    nodes.wait_up(process)
    store, profile = nodes.config_store()
    try:
        seeds = write_blocks(store, profile, nodes.name, 5)
        moved = movements_plan(snapshot=DRAIN_HOST, node=nodes.name, reason="manual")
        assert len(moved.written) == len(seeds)
        wait_for(
            lambda: all(state_of(i) == MovementState.DONE for i in moved.written),
            timeout=60,
            what="the blocks to reach the disk tier",
        )
        damaged = _damage(store, list(seeds))
        # A reader through the store: a miss (never the damaged bytes), and the tier drops the file.
        assert served_bytes_check(store, seeds) == {"served": 1, "missed": 4}
        assert not any(store.tier("disk").contains(k) for k in damaged.values())
        # The placements still say READY until the node's reconcile (a beat job) notices.
        assert movements_reconcile_nodes_task() == [nodes.name]
        wait_for(
            lambda: all(_copies(k) == {"disk": PlacementState.CORRUPT} for k in damaged.values()),
            timeout=60,
            what="the reconcile task to mark the copies without bytes",
        )
        assert _failures("reconcile") == 4
        assert blocks_of(seeds)  # the blocks themselves stay known: a miss recomputes them
        reconcile_and_check({nodes.name: store}, tiers=("host", "disk"))
    finally:
        store.close()
