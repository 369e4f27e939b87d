"""The embedded PostgreSQL is sized for the directory: shared buffers from the machine's memory,
checkpoints spaced for bursts of registrations, durability untouched."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psycopg
import pytest

from controlplane.runtime.embedded import EmbeddedPostgres, _memory_bytes, server_settings
from controlplane.runtime.environment import embedded_database_name, load_environment

GB = 1 << 30


@pytest.mark.parametrize(
    "memory, shared, cache",
    [
        (256 << 20, "128MB", "128MB"),  # never below PostgreSQL's default
        (4 * GB, "1024MB", "2048MB"),  # a quarter of memory; the planner counts on half
        (24 * GB, "6144MB", "12288MB"),
        (512 * GB, "8192MB", "262144MB"),  # at most 8 GB of buffers; the OS caches the rest
    ],
)
def test_shared_buffers_follow_memory(memory, shared, cache):
    settings = server_settings(memory)
    assert (settings["shared_buffers"], settings["effective_cache_size"]) == (shared, cache)


def test_checkpoints_are_spaced_and_durability_is_kept():
    settings = server_settings(24 * GB)
    assert settings["max_wal_size"] == "8GB" and settings["checkpoint_timeout"] == "15min"
    assert not {"fsync", "synchronous_commit", "full_page_writes"} & set(settings)


@pytest.mark.slow
def test_the_embedded_server_runs_with_them():
    var = Path(tempfile.mkdtemp(prefix="strata-private-pg-"))
    server = EmbeddedPostgres(load_environment({"STRATA_VAR_DIR": str(var / "var")}))
    try:
        server.start()
        with psycopg.connect(host=str(server.sockets), dbname=embedded_database_name(), user="postgres") as conn:
            shown = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in server_settings(_memory_bytes())}
            durable = [conn.execute(f"SHOW {name}").fetchone()[0] for name in ("fsync", "synchronous_commit")]
    finally:
        server.stop()
        shutil.rmtree(var, ignore_errors=True)
    expected = server_settings(_memory_bytes())
    assert shown["shared_buffers"] == _pretty(expected["shared_buffers"])
    assert (shown["max_wal_size"], shown["checkpoint_timeout"], shown["wal_buffers"]) == ("8GB", "15min", "64MB")
    assert durable == ["on", "on"]


def _pretty(megabytes: str) -> str:
    """PostgreSQL shows whole gigabytes as GB."""
    value = int(megabytes.removesuffix("MB"))
    return f"{value // 1024}GB" if value % 1024 == 0 else megabytes
