"""Fixtures for the data-plane tests: a hasher, a shared-memory name, a private Redis."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# The repository root (for `worker`) and this directory (for `dataplane_support`) must be
# importable however pytest was started and whatever its import mode.
for _path in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tests.support import RedisServer  # noqa: E402
from worker.dataplane.checksum import Hasher  # noqa: E402


@pytest.fixture
def hasher() -> Iterator[Hasher]:
    with Hasher(threads=2) as eng:
        yield eng


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    # Unix socket paths are limited to 107 bytes: keep it short, not under tmp_path.
    directory = Path(tempfile.mkdtemp(prefix="strata-redis-"))
    server = RedisServer(directory=directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def block_cache():
    """Random blocks by (layout, seed), generated once per module: random bf16/fp32 data for a
    32 MiB layout costs more than the I/O under test."""
    from dataplane_support import make_block  # noqa: PLC0415

    cache: dict = {}

    def get(layout, seed: int = 0):
        if (layout, seed) not in cache:
            cache[(layout, seed)] = make_block(layout, seed=seed)
        return cache[(layout, seed)]

    return get


@pytest.fixture
def open_tier(request, tmp_path, shm_name, hasher):
    """Build tiers by kind ('device', 'host', 'disk', 'remote'); all are closed (and the shared
    memory pool removed) at teardown, whatever the test did."""
    from worker.dataplane.counters import Counters  # noqa: PLC0415
    from worker.dataplane.tiers.device import DeviceTier  # noqa: PLC0415
    from worker.dataplane.tiers.disk import DiskTier  # noqa: PLC0415
    from worker.dataplane.tiers.host import HostTier  # noqa: PLC0415
    from worker.dataplane.tiers.remote import RemoteTier, redis_client  # noqa: PLC0415

    opened = []

    def build(kind: str, layout, *, blocks: int = 4, counters: Counters | None = None, **options):
        capacity = options.pop("capacity_bytes", None)
        if kind == "device":
            tier = DeviceTier(
                layout=layout,
                capacity_bytes=capacity or blocks * layout.block_bytes,
                device=options.pop("device", "cpu"),
                counters=counters,
                hasher=hasher,
                **options,
            )
        elif kind == "host":
            tier = HostTier(
                layout=layout,
                capacity_bytes=capacity or blocks * (layout.block_bytes + 4096),
                pool_name=options.pop("pool_name", shm_name),
                counters=counters,
                hasher=hasher,
                **options,
            )
        elif kind == "disk":
            tier = DiskTier(
                layout=layout,
                capacity_bytes=capacity or blocks * (layout.block_bytes + 2 * 65536),
                path=options.pop("path", tmp_path / "disk"),
                counters=counters,
                hasher=hasher,
                **options,
            )
        elif kind == "remote":
            server = request.getfixturevalue("redis_server")
            client = options.pop("client", None) or redis_client(server.url, timeout_s=2.0)
            tier = RemoteTier(
                layout=layout,
                capacity_bytes=capacity or blocks * (layout.block_bytes + 65536),
                client=client,
                prefix=options.pop("prefix", "test"),
                counters=counters,
                hasher=hasher,
                **options,
            )
        else:
            raise ValueError(kind)
        opened.append(tier)
        return tier

    yield build
    for tier in opened:
        tier.close()


@pytest.fixture
def held_unlinks(monkeypatch):
    """Hold the disk tier's background unlinks (of deleted blocks) until the test sets the event:
    the unlink thread waits before freeing a file's extents (its truncate, done outside the
    ledger's lock), so the file and its pending bytes stay."""
    release = threading.Event()
    real_truncate = os.truncate

    def truncate(path, *args, **kwargs):
        if threading.current_thread().name.endswith("-unlink"):
            release.wait(30)
        return real_truncate(path, *args, **kwargs)

    monkeypatch.setattr(os, "truncate", truncate)
    yield release
    release.set()
