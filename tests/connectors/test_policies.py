"""The vLLM connector's halves follow the policies in force: a new version's eviction rules,
quotas and write-through classes reach the write-back's offload manager; an older or a bad one
changes nothing (the bad one is named in the log), and a failing read keeps what is in force."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests.connectors.conftest import local_runtime
from worker.dataplane.connectors.vllm.runtime import PolicyFollower
from worker.dataplane.layout import ModelProfile

PROFILE = ModelProfile(model_id="pages", layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=16)

POLICIES = {
    "classes": [
        {"name": "default", "namespaces": [], "remote_write": "on-demotion"},
        {"name": "chat", "namespaces": ["chat"], "remote_write": "write-through", "weight": 4.0},
    ],
    "tiers": [
        {"tier": "host", "algorithm": "s3fifo", "ttl_seconds": None, "min_accesses": 0, "node_group": ""},
        {"tier": "host", "algorithm": "lfu", "ttl_seconds": 600, "min_accesses": 0, "node_group": "edge"},
    ],
    "quotas": [{"namespace": "chat", "tier": "host", "bytes": 1 << 20}],
}


@pytest.fixture
def runtime(tmp_path: Path, shm_name: str):
    with local_runtime(tmp_path, shm_name, PROFILE, "gpu-v", node_group="edge") as runtime:
        yield runtime


def test_a_new_version_reaches_the_write_back(runtime):
    reads = [(3, POLICIES)]
    follower = PolicyFollower(runtime, lambda: reads[-1], interval_s=60)
    assert follower.poll() is True and runtime.policy_version == 3
    rules = runtime.manager.evictor.rules
    assert rules.tier("host").algorithm == "lfu" and rules.tier("host").ttl_seconds == 600  # its group's
    assert rules.quota("chat", "host") == 1 << 20 and rules.weights["chat"] == 4.0
    writer = runtime.manager.remote_writer.policy
    assert writer.writes_through("chat") and not writer.writes_through("default")
    assert follower.poll() is False  # the same version again: nothing to do
    reads.append((2, {"classes": [], "tiers": [], "quotas": []}))  # a late, older version
    assert follower.poll() is False and runtime.policy_version == 3
    assert runtime.manager.evictor.rules.tier("host").algorithm == "lfu"


def test_a_bad_payload_or_a_failed_read_keeps_the_policy_in_force(runtime, caplog):
    good = PolicyFollower(runtime, lambda: (3, POLICIES), interval_s=60)
    assert good.poll()
    bad = {**POLICIES, "tiers": [{"tier": "host", "algorithm": "random"}]}
    follower = PolicyFollower(runtime, lambda: (4, bad), interval_s=60)
    with caplog.at_level(logging.WARNING, logger="strata.vllm"):
        assert follower.poll() is False
        assert follower.poll() is False
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1 and "tiers[0].algorithm: unknown algorithm 'random'" in messages[0]
    assert runtime.policy_version == 3 and runtime.manager.evictor.rules.tier("host").algorithm == "lfu"

    def down() -> tuple[int, dict]:
        raise ConnectionError("the database is down")

    assert PolicyFollower(runtime, down, interval_s=60).poll() is False
    assert runtime.policy_version == 3
    with pytest.raises(ValueError, match="interval_s: must be above zero"):
        PolicyFollower(runtime, down, interval_s=0)


def test_the_follower_reads_again_every_interval(runtime):
    versions = iter(range(1, 1000))
    follower = PolicyFollower(runtime, lambda: (next(versions), POLICIES), interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while runtime.policy_version < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        follower.close()
    assert runtime.policy_version >= 3
