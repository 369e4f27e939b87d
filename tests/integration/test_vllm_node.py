"""A vLLM node in the fleet, all real processes: `strata_node --engine vllm` starts vLLM with
StrataConnector, heartbeats with its tiers, shows its requests (per-layer stall) to the control
plane and both metrics endpoints to Prometheus; the official openai client is served from Strata's
tiers; an answer aborted mid-stream leaves nothing behind; the node's worker killed (SIGKILL) in the
middle of a movement while vLLM serves never makes vLLM read a torn block, and a new worker finishes
the movement; a policy edit reaches the connector inside vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.directory.models import Node, Placement
from controlplane.movements.choices import MovementState
from controlplane.movements.services import movements_plan
from tests.movements.procs import DRAIN_HOST, REPO_ROOT, reconcile_and_check, state_of
from tests.support import free_port, node_env, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.slow]

PROMPT = "Strata keeps KV blocks in DRAM and NVMe and loads them back layer by layer. " * 16


def _get(url: str, key: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return bytes(answer.read())


def _metric(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


class VllmNode:
    """The node's processes: its worker (`strata_node`), which starts vLLM, and any worker after it."""

    def __init__(self, env: dict[str, str], python: str, tmp_path: Any, checkpoint: Any) -> None:
        self.name = f"vllm-node-{os.getpid()}"
        self.serve_port, self.status_port = free_port(), free_port()
        self.env = {
            **node_env(env, self.name),
            "DJANGO_SETTINGS_MODULE": "tests.movements.fault_settings",
            "STRATA_HOST_POOL_NAME": f"strata-test-{self.name}",
            "STRATA_HOST_BYTES": "64MiB",
            "STRATA_TIERS": "host,disk",
            "STRATA_DISK_PATH": str(tmp_path / "disk"),
            "STRATA_DISK_BYTES": "256MiB",
            "STRATA_HEARTBEAT_SECONDS": "0.5",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "STRATA_VLLM_ARGS": "--max-model-len 4096 --num-gpu-blocks-override 64",
        }
        self.python, self.tmp, self.checkpoint = python, tmp_path, checkpoint
        self.workers: list[tuple[subprocess.Popen[bytes], Any]] = []
        self.vllm: psutil.Process | None = None

    def start_worker(self, **extra: str) -> tuple[subprocess.Popen[bytes], Any]:
        log = self.tmp / f"node-{len(self.workers)}.log"
        command = [
            self.python,
            "manage.py",
            "strata_node",
            "--name",
            self.name,
            "--engine",
            "vllm",
            "--model",
            str(self.checkpoint),
            "--serve-port",
            str(self.serve_port),
            "--status-port",
            str(self.status_port),
        ]
        worker = subprocess.Popen(
            command, cwd=REPO_ROOT, env={**self.env, **extra}, stdout=open(log, "wb"), stderr=subprocess.STDOUT
        )
        self.workers.append((worker, log))
        return worker, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.serve_port}{path}"

    def status(self, path: str) -> bytes:
        return _get(f"http://127.0.0.1:{self.status_port}{path}", self.env["STRATA_NODE_ADMIN_KEY"])

    def wait_serving(self, worker: subprocess.Popen[bytes]) -> None:
        def serving() -> bool:
            assert worker.poll() is None, f"the node exited with {worker.returncode}:\n{self.logs()}"
            try:
                _get(self.url("/v1/models"))
                return True
            except OSError:
                return False

        wait_for(serving, timeout=300, what="vLLM to serve", every=1)
        children = [
            p
            for p in psutil.Process(worker.pid).children()
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())
        ]
        if children:
            self.vllm = children[0]

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for _, log in self.workers)

    def stop(self) -> None:
        for worker, _ in self.workers:
            if worker.poll() is None:
                worker.terminate()
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:
                    worker.kill()
        if self.vllm is not None and self.vllm.is_running():
            # Its first worker was killed, so nobody stops this vLLM but the test: asked to stop,
            # it removes its shared-memory queues, which a SIGKILL would leave in /dev/shm.
            os.killpg(self.vllm.pid, signal.SIGTERM)
            try:
                self.vllm.wait(60)
            except psutil.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.vllm.pid, signal.SIGKILL)
        for pool in Path("/dev/shm").glob(f"strata-test-{self.name}*"):
            pool.unlink(missing_ok=True)


@pytest.fixture
def vllm_node(subprocess_env, python, tmp_path) -> Any:
    from worker.dataplane.models.loading import save_preset

    node = VllmNode(subprocess_env, python, tmp_path, save_preset("small", tmp_path / "small-ckpt"))
    yield node
    node.stop()
    print(node.logs())


def _complete(client: Any, model: str, **extra: Any) -> list[int]:
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True, **extra}
    )
    return list(answer.choices[0].model_extra["token_ids"])


def _reset(node: VllmNode) -> None:
    request = urllib.request.Request(node.url("/reset_prefix_cache"), method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass


def test_a_vllm_node_serves_from_strata_and_outlives_its_worker(vllm_node, settings):
    from openai import OpenAI

    from controlplane.dashboard.selectors import requests_recent

    node = vllm_node
    worker, log = node.start_worker(STRATA_FAULT_POINT="after-copy")
    node.wait_serving(worker)
    client = OpenAI(base_url=node.url("/v1"), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    # Served by vLLM; then, with vLLM's own cache emptied, from the node's host tier.
    cold = _complete(client, model)
    _reset(node)
    assert _complete(client, model) == cold
    row = wait_for(lambda: Node.objects.filter(name=node.name, state="up").first(), what="the node up")
    assert (row.engine, row.address, row.engine_address) == (
        "vllm",
        f"127.0.0.1:{node.status_port}",
        f"127.0.0.1:{node.serve_port}",
    )
    wait_for(lambda: row.tiers.filter(tier="host", used_bytes__gt=0).exists(), what="host use in a heartbeat")
    # The control plane reads the node with the key issued with its credential (node_env).
    timelines = requests_recent(node=node.name)
    assert timelines["nodes"] == [{"node": node.name, "error": ""}]
    hit = timelines["requests"][0]
    assert hit["hit_blocks_by_tier"].get("host", 0) >= 4 and len(hit["layer_stall_s"]) == 4
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length"

    # Both metrics endpoints: vLLM's own and the node's Strata endpoints.
    assert "vllm:num_requests_running" in _get(node.url("/metrics")).decode()
    assert _metric(node.status("/metrics").decode(), "strata_hit_tokens_total") >= 1024

    # A policy edit reaches the connector inside vLLM within a heartbeat interval.
    from controlplane.policies.services import priorityclass_create
    from controlplane.policies.snapshot import policies_snapshot

    priorityclass_create(name="vllm-chat", device_share=0.0, namespaces=["chat"], remote_write="write-through")
    version = policies_snapshot().version
    wait_for(
        lambda: _metric(node.status("/metrics").decode(), "strata_connector_policy_version") == version,
        timeout=30,
        what=f"the connector enforcing policy version {version}",
    )

    # An answer abandoned mid-stream: vLLM aborts it, the connector forgets it.
    stream = client.completions.create(
        model=model, prompt=PROMPT + " again", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    wait_for(
        lambda: _metric(node.status("/metrics").decode(), "strata_connector_requests") == 0,
        timeout=60,
        what="the aborted request forgotten",
    )

    # The worker moves the prompt's blocks to disk and is killed between copy and flip. The planner
    # works from the directory and the heartbeat: both hold the prompt's blocks first.
    block_bytes = 524288  # the small preset's 256-token block: 4 layers x K, V x 2 kv heads x 32 x fp32
    wait_for(
        lambda: Placement.objects.filter(node__name=node.name, tier="host", state="ready").count() >= 4,
        what="the prompt's blocks registered on host",
    )
    wait_for(
        lambda: row.tiers.filter(tier="host", used_bytes__gte=4 * block_bytes).exists(),
        what="the blocks' bytes in a heartbeat",
    )
    result = movements_plan(snapshot=DRAIN_HOST, node=node.name, reason="manual")
    assert result.written
    wait_for(lambda: "held at after-copy" in log.read_text(), timeout=60, what="a movement held after its copy")
    worker.kill()
    worker.wait(10)
    assert node.vllm is not None and node.vllm.is_running(), "vLLM must serve on without the node's worker"
    for _ in range(3):  # read while the movement is half done: the source copy, whole
        _reset(node)
        assert _complete(client, model) == cold
    assert json.loads(node.status("/v1/strata/requests"))["requests"][0]["load_failures"] == 0

    # A new worker beside the running vLLM: the broker delivers the movements again, they finish.
    second, _ = node.start_worker(STRATA_VLLM_LAUNCH="false")
    wait_for(
        lambda: all(state_of(i) == MovementState.DONE for i in result.written),
        timeout=120,
        what="the redelivered movements",
    )
    assert Placement.objects.filter(node__name=node.name, tier="disk", state="ready").count() >= 4
    _reset(node)
    assert _complete(client, model) == cold
    trace = json.loads(node.status("/v1/strata/requests"))["requests"][0]
    assert trace["hit_blocks_by_tier"].get("disk", 0) >= 4 and trace["load_failures"] == 0
    from worker.dataplane.config import load_config
    from worker.dataplane.models.loading import checkpoint_profile
    from worker.dataplane.store import build_store

    config = load_config(environ=node.env, overrides={"node_name": node.name})
    store = build_store(
        config, profile=checkpoint_profile(node.checkpoint, dtype="float32", block_tokens=256), environ=node.env
    )
    try:
        assert reconcile_and_check({node.name: store}, tiers=("host", "disk")).checked >= 4
    finally:
        store.close()
    second.terminate()
