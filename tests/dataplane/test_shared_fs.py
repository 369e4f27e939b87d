"""A disk-tier directory shared by several hosts (the remote tier on a CephFS/NFS/Lustre mount):
temporary files carry the writer's host, and opening the tier judges only its own host's by pid."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
from dataplane_support import SMALL, key, layout_of

from worker.dataplane.tiers.disk import FOREIGN_TEMP_GRACE_SECONDS, DiskTier, host_token

LAYOUT = layout_of(SMALL, "bfloat16")
DEAD_PID = 999_999_999  # above any pid_max: no such process on any host


def _temp(root: Path, n: int, *, pid: int, reserved: int, host: str | None) -> Path:
    """A temporary file as a writer on `host` leaves it (no host: the old name format)."""
    k = key(n).hex
    name = f".{k}.{pid}.cafe{n:04x}.{reserved}" + (f".{host}" if host is not None else "") + ".tmp"
    path = root / k[:2] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"in flight")
    return path


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def on_host(monkeypatch):
    """Open tiers as if on the named host (socket.gethostname)."""

    def set_host(name: str) -> None:
        monkeypatch.setattr(socket, "gethostname", lambda: name)

    return set_host


def test_host_token_is_a_safe_file_name_part(monkeypatch) -> None:
    assert host_token("gpu-07") == "gpu-07"
    assert host_token("gpu-07.rack2.example.com") == "gpu-07-rack2-example-com"
    token = host_token("nœud 3/../x")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token) and "." not in token and "/" not in token
    assert len(host_token("h" * 300)) <= 63
    assert host_token("...") == "unnamed-host"
    monkeypatch.setattr(socket, "gethostname", lambda: "worker_5.local")
    assert host_token() == "worker_5-local"


def test_a_writers_temp_file_names_its_host(open_tier, block_cache, on_host, monkeypatch) -> None:
    on_host("gpu-a.cluster")
    tier = open_tier("disk", LAYOUT, blocks=2)
    names: list[str] = []
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        names.append(Path(src).name)
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    tier.put(key(1), block_cache(LAYOUT, 1))
    [name] = names
    assert name.startswith(f".{key(1).hex}.{os.getpid()}.")
    assert name.endswith(f".{tier.file_bytes}.gpu-a-cluster.tmp")


def test_opening_the_tier_keeps_another_hosts_writes_in_flight(tmp_path, on_host) -> None:
    root = tmp_path / "mount" / "strata"
    reserved = 3 * 1024 * 1024
    on_host("node-a")
    first = DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=root)
    try:
        # node-b is writing a block; its pid means nothing on this host (here: no such process).
        foreign = _temp(root, 1, pid=DEAD_PID, reserved=reserved, host="node-b")
        first.reconcile()
        assert foreign.exists()
        assert first.usage().pending_bytes == reserved  # its reservation is kept in the ledger
        on_host("node-c")  # a third node opening the same directory leaves it alone too
        third = DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=root)
        third.close()
        assert foreign.exists() and first.usage().pending_bytes == reserved
    finally:
        first.close()


def test_another_hosts_temp_file_past_the_grace_period_is_removed(tmp_path, on_host) -> None:
    root = tmp_path / "mount" / "strata"
    on_host("node-a")
    tier = DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=root)
    try:
        abandoned = _temp(root, 1, pid=DEAD_PID, reserved=4096, host="node-b")
        recent = _temp(root, 2, pid=DEAD_PID, reserved=8192, host="node-b")
        _age(abandoned, FOREIGN_TEMP_GRACE_SECONDS + 60)
        _age(recent, FOREIGN_TEMP_GRACE_SECONDS - 60)
        assert tier.reconcile().pending_bytes == 8192
        assert not abandoned.exists() and recent.exists()
    finally:
        tier.close()


def test_this_hosts_temp_files_are_judged_by_pid(tmp_path, on_host) -> None:
    root = tmp_path / "mount" / "strata"
    on_host("node-a.example")
    tier = DiskTier(layout=LAYOUT, capacity_bytes=1 << 30, path=root)
    try:
        own = host_token()
        dead = _temp(root, 1, pid=DEAD_PID, reserved=4096, host=own)
        live = _temp(root, 2, pid=os.getpid(), reserved=8192, host=own)
        # Names written before the host was recorded are this host's: judged by pid as before.
        old_dead = _temp(root, 3, pid=DEAD_PID, reserved=4096, host=None)
        old_live = _temp(root, 4, pid=os.getpid(), reserved=16384, host=None)
        # A dead writer of this host is gone however recent its file is.
        usage = tier.reconcile()
        assert not dead.exists() and not old_dead.exists()
        assert live.exists() and old_live.exists()
        assert usage.pending_bytes == 8192 + 16384
    finally:
        tier.close()
