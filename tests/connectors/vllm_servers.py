"""vLLM's OpenAI server as the tests about it start it: a process group of its own, float32, ready
when /v1/models answers, stopped (and its Strata host pools removed) whatever the test did."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import free_port


def strata_transfer(extra: Mapping[str, Any]) -> str:
    """--kv-transfer-config for Strata's connector without a directory (`StrataConnectorBase`),
    its node options `extra`."""
    return json.dumps(
        {
            "kv_connector": "StrataConnectorBase",
            "kv_connector_module_path": "worker.dataplane.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra),
        }
    )


@contextlib.contextmanager
def openai_server(
    checkpoint: Path,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    pools: Sequence[str] = (),
    label: str = "vllm",
    start_timeout: float = 420,
) -> Iterator[dict[str, str]]:
    """A vLLM OpenAI server on `checkpoint` with vLLM's options `args`, its environment this
    process's plus `env`; yields its `base` URL and served `model`. `pools`: the /dev/shm names
    (prefixes) of the Strata host pools it opens, removed when it stops."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "1024", *args]
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log = tempfile.NamedTemporaryFile(prefix=f"{label}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                text = Path(log.name).read_text()
                causes = "\n".join(line for line in text.splitlines() if "Error" in line)[-3000:]
                raise AssertionError(f"vLLM exited at start: {causes}\n...\n{text[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as answer:
                    model = str(json.loads(answer.read())["data"][0]["id"])
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield {"base": base, "model": model}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        for pool in pools:
            for path in Path("/dev/shm").glob(f"{pool}*"):
                path.unlink(missing_ok=True)
        os.unlink(log.name)
