"""A real node process (`strata_node --model tiny`) serving the OpenAI API, for the tests here."""

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port, node_env

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def serving_node(subprocess_env, python, tmp_path) -> Iterator[tuple[str, int]]:
    name = f"eng-{uuid.uuid4().hex[:6]}"
    port = free_port()
    log = open(tmp_path / "node.log", "w+")
    env = {
        **node_env(subprocess_env, name),
        "STRATA_HOST_POOL_NAME": f"strata-test-{name}",
        "STRATA_BLOCK_TOKENS": "16",
        "STRATA_HOST_BYTES": "64MiB",
        "STRATA_DEVICE_BYTES": "8MiB",
        "STRATA_TIERS": "device,host,disk",
        "STRATA_CLIENT_NAMESPACES": "true",  # the tests name tenants by X-Strata-Namespace
    }
    process = subprocess.Popen(
        [
            python,
            "manage.py",
            "strata_node",
            "--name",
            name,
            "--heartbeat-seconds",
            "0.5",
            "--model",
            "tiny",
            "--serve-port",
            str(port),
            "--disk-path",
            str(tmp_path / "disk"),
            "--disk-bytes",
            "64MiB",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield name, port
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.seek(0)
        print(log.read()[-5000:])
        log.close()
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink()
