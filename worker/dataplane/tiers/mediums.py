"""One spec per storage medium, each with the function that opens it as a tier.

A tier *level* (`tier_names.TIER_ORDER`: device, host, disk, remote) is configuration: the store's
factory maps each configured level to the spec of the medium that serves it, and the level's
name becomes the tier's name. The mediums:

* `DevicePages`: pages of GPU memory (or CPU memory where there is no GPU), `DeviceTier`.
* `SharedMemoryPool`: a pool in /dev/shm that every process of the node maps, `HostTier`.
* `FileDirectory`: one file per block in a directory, on a local disk or on a filesystem that
  several hosts mount (CephFS, NFS, Lustre, 3FS), `DiskTier`; temporary file names carry the
  writer's host, so hosts sharing the directory never remove each other's live writes.
* `RedisStore`: a Redis/Valkey deployment, standalone or cluster, `RemoteTier`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from urllib.parse import urlparse

import torch

from worker.dataplane.checksum import Hasher
from worker.dataplane.counters import Counters
from worker.dataplane.layout import BlockLayout
from worker.dataplane.network import ConnectionOptions
from worker.dataplane.redis_policy import refuse_evicting
from worker.dataplane.tiers.base import Tier
from worker.dataplane.tiers.device import DeviceTier
from worker.dataplane.tiers.disk import REUSE_DELETED_S, DiskTier
from worker.dataplane.tiers.host import SHM_DIR, HostTier
from worker.dataplane.tiers.remote import RedisClient, RemoteTier, redis_client


@dataclasses.dataclass(frozen=True, slots=True)
class DevicePages:
    """`capacity_bytes` of pages on `device` (None: the default device)."""

    capacity_bytes: int
    device: torch.device | str | None = None

    def open(
        self, *, name: str, layout: BlockLayout, counters: Counters | None = None, hasher: Hasher | None = None
    ) -> DeviceTier:
        return DeviceTier(
            layout=layout,
            capacity_bytes=self.capacity_bytes,
            device=self.device,
            counters=counters,
            hasher=hasher,
            name=name,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SharedMemoryPool:
    """A pool named `pool_name` in `shm_dir`, created with `capacity_bytes` by the first process
    that opens it; `pin` None pins it for CUDA where CUDA is present."""

    capacity_bytes: int
    pool_name: str
    shm_dir: Path = SHM_DIR
    pin: bool | None = None

    def open(
        self, *, name: str, layout: BlockLayout, counters: Counters | None = None, hasher: Hasher | None = None
    ) -> HostTier:
        return HostTier(
            layout=layout,
            capacity_bytes=self.capacity_bytes,
            pool_name=self.pool_name,
            counters=counters,
            hasher=hasher,
            pin=self.pin,
            shm_dir=self.shm_dir,
            name=name,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FileDirectory:
    """Block files under `path`, `capacity_bytes` of them, local or on a shared mount."""

    capacity_bytes: int
    path: Path
    io_threads: int = 4
    direct_io: bool = True
    reuse_deleted_s: float = REUSE_DELETED_S

    def open(
        self, *, name: str, layout: BlockLayout, counters: Counters | None = None, hasher: Hasher | None = None
    ) -> DiskTier:
        return DiskTier(
            layout=layout,
            capacity_bytes=self.capacity_bytes,
            path=self.path,
            counters=counters,
            hasher=hasher,
            io_threads=self.io_threads,
            direct_io=self.direct_io,
            name=name,
            reuse_deleted_s=self.reuse_deleted_s,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RedisStore:
    """Blocks under `prefix` in the Redis/Valkey at `url` (`cluster` for a Redis Cluster), or
    through a ready `client`, `capacity_bytes` of them for the whole deployment."""

    capacity_bytes: int
    url: str
    prefix: str
    io_threads: int = 2
    cluster: bool = False
    timeout_s: float = 2.0
    client: RedisClient | None = dataclasses.field(default=None, compare=False)
    connection: ConnectionOptions = ConnectionOptions()
    """Keepalives and health checks of the client built from `url`."""

    def open(
        self, *, name: str, layout: BlockLayout, counters: Counters | None = None, hasher: Hasher | None = None
    ) -> RemoteTier:
        client = self.client
        if client is None:
            client = redis_client(self.url, cluster=self.cluster, timeout_s=self.timeout_s, connection=self.connection)
        refuse_evicting(client, f"remote tier {name}")
        return RemoteTier(
            layout=layout,
            capacity_bytes=self.capacity_bytes,
            client=client,
            prefix=self.prefix,
            counters=counters,
            hasher=hasher,
            io_threads=self.io_threads,
            name=name,
        )


Medium = DevicePages | SharedMemoryPool | FileDirectory | RedisStore


def is_filesystem_url(url: str) -> bool:
    """True for a directory path or file:// URL (a shared filesystem mount), False for Redis."""
    scheme = urlparse(url).scheme
    return scheme in ("", "file")


def remote_medium(
    url: str,
    *,
    capacity_bytes: int,
    prefix: str,
    io_threads: int = 2,
    cluster: bool = False,
    timeout_s: float = 2.0,
    client: RedisClient | None = None,
    connection: ConnectionOptions | None = None,
) -> FileDirectory | RedisStore:
    """The medium of a remote store at `url`: redis://, rediss:// or unix:// is Redis/Valkey
    (`cluster` for a Redis Cluster); a directory path or file:// URL is a shared filesystem
    mount, whose blocks go under `<path>/<prefix>` with O_DIRECT where the filesystem allows it
    (buffered I/O plus posix_fadvise(DONTNEED) where it refuses, logged once). A ready client
    makes it Redis whatever the URL."""
    if client is None and is_filesystem_url(url):
        root = Path(urlparse(url).path if url.startswith("file:") else url).expanduser() / prefix
        return FileDirectory(capacity_bytes=capacity_bytes, path=root, io_threads=io_threads, direct_io=True)
    return RedisStore(
        capacity_bytes=capacity_bytes,
        url=url,
        prefix=prefix,
        io_threads=io_threads,
        cluster=cluster,
        timeout_s=timeout_s,
        client=client,
        connection=connection or ConnectionOptions(),
    )


def open_remote_tier(
    url: str,
    *,
    layout: BlockLayout,
    capacity_bytes: int,
    prefix: str,
    counters: Counters | None = None,
    hasher: Hasher | None = None,
    io_threads: int = 2,
    cluster: bool = False,
    timeout_s: float = 2.0,
    client: RedisClient | None = None,
) -> Tier:
    """The tier named ``remote`` on the medium `remote_medium` picks for `url`."""
    medium = remote_medium(
        url,
        capacity_bytes=capacity_bytes,
        prefix=prefix,
        io_threads=io_threads,
        cluster=cluster,
        timeout_s=timeout_s,
        client=client,
    )
    return medium.open(name="remote", layout=layout, counters=counters, hasher=hasher)
