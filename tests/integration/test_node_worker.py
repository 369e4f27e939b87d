"""A real node process (`manage.py strata_node`): its Celery worker heartbeats into PostgreSQL, consumes
its own queue, marks itself down on SIGTERM and goes stale when killed."""

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.directory.services import nodes_mark_stale
from tests.support import node_env, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


@pytest.fixture
def node_process(subprocess_env, python, tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    log = open(tmp_path / "node.log", "w+")
    process = subprocess.Popen(
        [
            python,
            "manage.py",
            "strata_node",
            "--name",
            name,
            "--heartbeat-seconds",
            "0.5",
            "--disk-path",
            str(tmp_path / "disk"),
            "--disk-bytes",
            "64MiB",
        ],
        cwd=REPO_ROOT,
        env=node_env(subprocess_env, name),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield name, process
    if process.poll() is None:
        process.kill()
        process.wait(10)
    log.seek(0)
    print(log.read()[-4000:])
    log.close()


def test_worker_heartbeats_consumes_its_queue_and_marks_itself_down(node_process):
    name, process = node_process
    node = wait_for(lambda: Node.objects.filter(name=name, heartbeats__gte=2).first(), what="two heartbeats")
    assert node.state == NodeState.UP
    assert node.pid == process.pid
    assert {t.tier: t.capacity_bytes for t in node.tiers.all()}["disk"] == 64 * 1024**2

    # The control plane can reach this node through its own queue.
    from controlplane.celery_app import app

    before = Node.objects.get(name=name).heartbeats
    sent_at = time.monotonic()
    app.send_task("node.report", queue=f"node.{name}")
    wait_for(lambda: Node.objects.get(name=name).heartbeats > before + 1 or None, what="node.report")
    assert time.monotonic() - sent_at < 10

    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert Node.objects.get(name=name).state == NodeState.DOWN


def test_killed_worker_goes_stale(node_process):
    name, process = node_process
    wait_for(lambda: Node.objects.filter(name=name, heartbeats__gte=1).exists(), what="a heartbeat")
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    # 3 missed heartbeats of 0.5 s, then the sweep marks it stale.
    wait_for(lambda: name in nodes_mark_stale() or None, timeout=10, what="stale detection")
    assert Node.objects.get(name=name).state == NodeState.STALE


def test_bad_node_option_stops_with_a_message(subprocess_env, python):
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-0", "--host-bytes", "lots"],
        cwd=REPO_ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--host-bytes: expected a size such as 512MiB or 2GB, got 'lots'" in result.stderr
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-0"],
        cwd=REPO_ROOT,
        env={**subprocess_env, "STRATA_HEARTBEAT_SECONDS": "-1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "STRATA_HEARTBEAT_SECONDS: must be 0.1 to 3600 seconds" in result.stderr
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-0"],
        cwd=REPO_ROOT,
        env={**subprocess_env, "STRATA_TCP_USER_TIMEOUT_SECONDS": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "STRATA_TCP_USER_TIMEOUT_SECONDS: must be 0.5 to 600 seconds, got '0'" in result.stderr
    result = subprocess.run(
        [python, "manage.py", "strata_node", "--name", "gpu-0", "--model", "no-such-model"],
        cwd=REPO_ROOT,
        env=node_env(subprocess_env, "gpu-0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("strata_node: model: 'no-such-model' is neither a preset")
