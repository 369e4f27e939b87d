"""Fragments another node stored, found through the directory: one vLLM node reads the multi-hop
fixture's passages and writes its blocks to the shared remote tier (L3); a second node, which never
saw them, serves the questions (the passages in new orders) from those blocks: their content keys
found in the directory, each copy read from L3 checked against the checksum the directory
registered, r% recomputed. Its answers are vLLM alone's."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connectors.conftest import environment
from tests.connectors.test_blend_vllm import accuracy, answers, engine, task
from tests.support import RedisServer, free_port, node_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLENDED = 4 * 32
"""Cached prompt tokens past which a question was served from fragments."""
QUESTIONS = 30


@pytest.fixture(scope="module")
def fleet(directory_db, vllm_environment) -> Iterator[dict[str, Any]]:
    from controlplane.directory.services import TierReport, namespace_ensure, node_heartbeat

    work = Path(tempfile.mkdtemp(prefix="strata-blend-fleet-"))
    remote = RedisServer(directory=work)
    remote.start()
    shared = f"strata-test-fleet-{uuid.uuid4().hex[:6]}"
    names = [f"blend-{side}-{uuid.uuid4().hex[:6]}" for side in ("a", "b")]
    try:
        for name in names:
            node_heartbeat(
                name=name,
                host="test",
                heartbeat_seconds=3600.0,
                tiers=[TierReport(tier=t, capacity_bytes=1 << 30, used_bytes=0) for t in ("host", "remote")],
            )
        namespace_ensure(name="default")
        yield {"names": names, "remote": remote, "prefix": shared, "env": vllm_environment}
    finally:
        remote.stop()
        shutil.rmtree(work, ignore_errors=True)
        for name in names:
            for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
                pool.unlink(missing_ok=True)


def transfer(fleet: dict[str, Any], name: str, tiers: str, port: int) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="StrataConnector",
        kv_connector_module_path="worker.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "node_name": name,
            "tiers": tiers,
            "host_pool_name": f"strata-test-{name}",
            "host_bytes": "64MiB",
            "remote_url": fleet["remote"].url,
            "remote_prefix": fleet["prefix"],
            "remote_bytes": "256MiB",
            "block_tokens": 32,
            "blend": True,
            "blend_sample_rate": 0.0,
            "status_port": port,
        },
    )


def test_a_node_serves_questions_from_the_fragments_another_node_wrote_to_l3(fleet) -> None:
    warm, questions = task()
    questions = questions[:QUESTIONS]
    plain = engine()
    try:
        reference = answers(plain, [q.prompt for q in questions])
    finally:
        plain.llm_engine.engine_core.shutdown()

    writer_name, reader_name = fleet["names"]
    with environment(node_env(fleet["env"], writer_name)):
        writer = engine(transfer(fleet, writer_name, "remote", free_port()))
    try:
        answers(writer, warm)
        time.sleep(3.0)  # the save queue's thread stores the warm-up's blocks outside the step
    finally:
        writer.llm_engine.engine_core.shutdown()

    port = free_port()
    reader_env = node_env(fleet["env"], reader_name)
    with environment(reader_env):
        reader = engine(transfer(fleet, reader_name, "host,remote", port))
    try:
        served = [answers(reader, [q.prompt])[0] for q in questions]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/strata/requests?limit={QUESTIONS}",
            headers={"Authorization": f"Bearer {reader_env['STRATA_NODE_ADMIN_KEY']}"},
        )
        with urllib.request.urlopen(request, timeout=30) as page:
            timelines = json.loads(page.read())["requests"]
    finally:
        reader.llm_engine.engine_core.shutdown()

    cached = [o.num_cached_tokens or 0 for o in served]
    assert sum(c >= BLENDED for c in cached) >= 0.9 * QUESTIONS, cached
    # The reader's own tiers held nothing: every fragment was read from L3, checked against the directory.
    tiers = [t["fragment_blocks_by_tier"] for t in timelines if t["fragment_blocks_by_tier"]]
    assert len(tiers) >= 0.9 * QUESTIONS and all(set(t) == {"remote"} for t in tiers), tiers
    assert accuracy(served, questions) >= accuracy(reference, questions) - 2 / QUESTIONS
