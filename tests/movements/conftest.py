"""Fixtures of the movements tests: a small block layout, nodes with reported tiers, blocks with
chosen ages and access counts, policy snapshots, and a real tiered store (host pool in /dev/shm,
disk in tmp_path, remote in the embedded Redis under a private prefix)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from controlplane.directory.models import Block, ModelProfile, Namespace, Node, Placement
from controlplane.directory.services import (
    TierReport,
    blocks_register,
    modelprofile_create,
    node_heartbeat,
)
from controlplane.policies.snapshot import PolicySnapshot, PriorityClassSpec, TierPolicySpec
from worker.dataplane.directory import BlockRegistration

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 2, 2, 16, 16
BLOCK_BYTES = 2 * LAYERS * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2  # float16


@pytest.fixture(autouse=True)
def throttle_cache(monkeypatch):  # type: ignore[no-untyped-def]
    """Rate limits counted afresh in each test (the Redis cache outlives test databases)."""
    from django.core.cache.backends.locmem import LocMemCache
    from rest_framework.throttling import SimpleRateThrottle

    monkeypatch.setattr(SimpleRateThrottle, "cache", LocMemCache(f"throttle-{uuid.uuid4().hex}", {}))


@pytest.fixture
def profile(db) -> ModelProfile:  # type: ignore[no-untyped-def]
    return modelprofile_create(
        name="tiny-llama",
        model_id="strata/tiny-llama",
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="float16",
        block_tokens=BLOCK_TOKENS,
    )


@pytest.fixture
def namespaces(db) -> dict[str, Namespace]:  # type: ignore[no-untyped-def]
    return {name: Namespace.objects.create(name=name) for name in ("tenant-a", "batch", "realtime")}


def flip_a_data_byte(path: str | Path) -> None:
    """Invert one byte near the end of a block file: its data, not its header."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(os.path.getsize(path) - 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def node_report(name: str, **tiers: tuple[int, int]) -> Node:
    """Heartbeat a node whose tiers report (capacity, used) bytes, e.g. host=(10 * B, 9 * B)."""
    return node_heartbeat(
        name=name,
        host="host-" + name,
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier=t, capacity_bytes=c, used_bytes=u) for t, (c, u) in tiers.items()],
    )


@pytest.fixture
def make_blocks(profile, namespaces) -> Callable[..., list[Block]]:  # type: ignore[no-untyped-def]
    """Register `count` blocks with a READY copy in (tier, node); `ages` (seconds since last
    access), `accesses`, `created` (seconds ago) and `positions` set per block."""

    def build(
        count: int,
        *,
        tier: str = "host",
        node: str | None = "gpu-0",
        namespace: str = "tenant-a",
        ages: list[float] | None = None,
        accesses: list[int] | None = None,
        created: list[float] | None = None,
        positions: list[int] | None = None,
        checksums: list[str] | None = None,
        keys: list[uuid.UUID] | None = None,
        priority: str = "default",
        now: datetime | None = None,
    ) -> list[Block]:
        now = now or timezone.now()
        keys = keys or [uuid.uuid4() for _ in range(count)]
        blocks_register(
            registrations=[
                BlockRegistration(
                    namespace=namespace,
                    model_key=profile.model_key,
                    prefix_key=keys[i],
                    content_key=uuid.uuid4(),
                    position=(positions or [0] * count)[i],
                    tokens=BLOCK_TOKENS,
                    tier=tier,
                    node=None if tier == "remote" else node,
                    nbytes=BLOCK_BYTES,
                    checksum=(checksums or ["0" * 32] * count)[i],
                    priority=priority,
                )
                for i in range(count)
            ],
            now=now,
        )
        blocks = {b.prefix_key: b for b in Block.objects.filter(prefix_key__in=keys)}
        ordered = [blocks[k] for k in keys]
        for i, block in enumerate(ordered):
            block.last_access_at = now - timedelta(seconds=(ages or [0.0] * count)[i])
            block.access_count = (accesses or [0] * count)[i]
            block.created_at = now - timedelta(seconds=(created or [0.0] * count)[i])
            block.save(update_fields=["last_access_at", "access_count", "created_at"])
        return ordered

    return build


def snapshot(
    *tiers: TierPolicySpec, classes: tuple[PriorityClassSpec, ...] = (), version: int = 7, mode: str = ""
) -> PolicySnapshot:
    return PolicySnapshot(version=version, mode=mode, classes=classes, tiers=tiers)


def placements(block: Block) -> dict[tuple[str, str], str]:
    """(tier, node name) -> state of every copy of a block."""
    return {
        (p.tier, p.node.name if p.node else ""): p.state
        for p in Placement.objects.filter(block=block).select_related("node")
    }


# -- a real tiered store ----------------------------------------------------------------------------


@pytest.fixture
def redis_url(settings) -> str:  # type: ignore[no-untyped-def]
    return settings.ENV.redis.url_for_db(settings.ENV.redis.db + 3)


@pytest.fixture
def store_factory(tmp_path, redis_url) -> Iterator[Callable[..., object]]:
    """Build TieredStores of the test layout with host (a unique /dev/shm pool), disk (under
    tmp_path) and remote (the embedded Redis, a unique key prefix); all closed and removed after."""
    from worker.dataplane.layout import BlockLayout
    from worker.dataplane.store import TieredStore
    from worker.dataplane.tiers.disk import DiskTier
    from worker.dataplane.tiers.host import HostTier
    from worker.dataplane.tiers.remote import RemoteTier, redis_client

    pool = f"strata-test-mv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    prefix = f"strata-test-mv-{uuid.uuid4().hex[:8]}"
    layout = BlockLayout(
        layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_tokens=BLOCK_TOKENS, dtype="float16"
    )
    built: list[TieredStore] = []

    def build(
        *,
        blocks: int = 16,
        disk_bytes: int | None = None,
        tiers: tuple[str, ...] = ("host", "disk", "remote"),
        disk_path: Path | None = None,
    ) -> TieredStore:
        made = []
        if "host" in tiers:
            made.append(HostTier(layout=layout, capacity_bytes=blocks * (layout.block_bytes + 4096), pool_name=pool))
        if "disk" in tiers:
            made.append(
                DiskTier(
                    layout=layout,
                    capacity_bytes=disk_bytes or blocks * (layout.block_bytes + 2 * 65536),
                    path=disk_path or tmp_path / "disk",
                )
            )
        if "remote" in tiers:
            made.append(
                RemoteTier(
                    layout=layout,
                    capacity_bytes=blocks * (layout.block_bytes + 65536),
                    client=redis_client(redis_url, timeout_s=2.0),
                    prefix=prefix,
                )
            )
        store = TieredStore(layout=layout, tiers=made)
        built.append(store)
        return store

    yield build
    for store in built:
        if "remote" in store.names:
            client = store.tier("remote").client
            for name in client.scan_iter(match=f"{prefix}:*"):
                client.delete(name)
        store.close()
    for path in Path("/dev/shm").glob(f"{pool}*"):
        path.unlink(missing_ok=True)


def record_moves(
    blocks: list[Block], kind: str, dst_tier: str, *, exec_node: str = "gpu-0", policy_version: int = 1
) -> list[int]:
    """Movements of `blocks` from their only copy to `dst_tier`, recorded by the real service as a
    plan would; their ids in the order of `blocks`."""
    from controlplane.movements.models import Movement
    from controlplane.movements.planner import PlannedMovement
    from controlplane.movements.services import movements_record

    planned = []
    for block in blocks:
        source = Placement.objects.get(block=block)
        planned.append(
            PlannedMovement(
                block_id=block.id,
                kind=kind,
                reason="manual",
                src_placement_id=source.id,
                src_epoch=source.epoch,
                src_tier=source.tier,
                src_node=source.node.name if source.node else "",
                dst_tier=dst_tier,
                dst_node="" if dst_tier == "remote" else exec_node,
                exec_node=exec_node,
                bytes=source.size_bytes,
            )
        )
    ids = movements_record(
        plan_id=uuid.uuid4(), movements=planned, policy_version=policy_version, mode="", now=timezone.now()
    )
    by_block = dict(Movement.objects.filter(id__in=ids).values_list("block_id", "id"))
    return [by_block[block.id] for block in blocks]


def read_block(store, block: Block, tier: str):  # type: ignore[no-untyped-def]
    """The bytes of `block` as `tier` of `store` serves them (verified)."""
    out = store.layout.empty()
    store.tier(tier).get(block.prefix_key, out)
    return out


def random_block(layout, seed: int):  # type: ignore[no-untyped-def]
    import torch

    generator = torch.Generator().manual_seed(seed)
    data = layout.empty()
    data.copy_(torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=generator))
    return data


# -- real node processes -----------------------------------------------------------------------------


@pytest.fixture
def node_factory(subprocess_env, python, tmp_path) -> Iterator[Callable[..., object]]:  # type: ignore[no-untyped-def]
    """Build NodeProcesses (tests/movements/procs.py): one node name each, options as keywords
    (`env` replaces the child environment); every process they started is stopped after the test."""
    from tests.movements.procs import NodeProcesses

    made: list[NodeProcesses] = []

    def build(*, env: dict[str, str] | None = None, **options: object) -> NodeProcesses:
        nodes = NodeProcesses(env or subprocess_env, python, tmp_path, **options)  # type: ignore[arg-type]
        made.append(nodes)
        return nodes

    yield build
    for nodes in made:
        nodes.stop_all()
