"""The GPU side-by-side script's `plan`: each configuration's server command and environment, the
connector configurations it passes (Strata's checked against the node's option table, the others
against the installed vLLM's source where there is one), and refusals that name the bad input."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.workloads.sessions import Shape
from worker.dataplane.config import OPTIONS, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks.scripts.gpu_side_by_side"
CONFIGS = ("vllm", "offloading", "lmcache", "strata", "strata_blend")


def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", SCRIPT, *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )


def planned(*args: str) -> dict[str, dict[str, Any]]:
    """Per configuration `plan` printed: its command's arguments, its environment, and the
    --kv-transfer-config it passes (None for vLLM alone)."""
    done = script("plan", *args)
    assert done.returncode == 0, done.stderr
    found: dict[str, dict[str, Any]] = {}
    config = ""
    for line in done.stdout.splitlines():
        if line.startswith("== "):
            config = line[3:].split(":", 1)[0]
            found[config] = {}
        elif line.startswith("env: "):
            found[config]["env"] = dict(item.split("=", 1) for item in shlex.split(line[5:]))
        elif line.startswith("command: "):
            argv = shlex.split(line[9:])
            found[config]["argv"] = argv
            at = argv.index("--kv-transfer-config") if "--kv-transfer-config" in argv else -1
            found[config]["transfer"] = json.loads(argv[at + 1]) if at >= 0 else None
    return found


@pytest.fixture(scope="module")
def plan() -> dict[str, dict[str, Any]]:
    return planned()


def vllm_source(relative: str) -> str:
    """A file of the installed vLLM package (the vllm extra), read without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed: make setup installs it"
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def test_every_configuration_is_planned_on_the_same_server_arguments(plan):
    assert list(plan) == list(CONFIGS)
    for config, server in plan.items():
        argv = server["argv"]
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], config
        assert argv[argv.index("--model") + 1] == "<checkpoint>"
        for flag in (
            "--num-gpu-blocks-override",
            "--block-size",
            "--max-model-len",
            "--enable-prefix-caching",
            "--attention-backend",
            "--enforce-eager",
        ):
            assert flag in argv, (config, flag)
        assert argv[argv.index("--block-size") + 1] == "16"
        # The CPU suite's KV space (pages of 128 tokens) in 16-token pages, room for the longest prompt.
        kv_tokens = int(argv[argv.index("--num-gpu-blocks-override") + 1]) * 16
        assert kv_tokens == Shape().pages * 128
        assert kv_tokens >= int(argv[argv.index("--max-model-len") + 1]) == Shape().max_model_len
    assert plan["vllm"]["transfer"] is None


def test_two_gpus_serve_every_configuration_at_tensor_parallel_two_under_cuda_graphs():
    """What `run` starts where the machine has two GPUs (its defaults there; asked for here)."""
    for config, server in planned("--tensor-parallel", "2", "--cuda-graphs").items():
        argv = server["argv"]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2", config
        assert "--enforce-eager" not in argv, config


def test_offloading_connector_gets_its_cpu_space(plan):
    transfer = plan["offloading"]["transfer"]
    assert transfer["kv_connector"] == "OffloadingConnector"
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_connector_extra_config"] == {"cpu_bytes_to_use": 8 * 2**30}
    assert '"cpu_bytes_to_use"' in vllm_source("v1/kv_offload/cpu/spec.py")


def test_lmcache_is_configured_by_its_variables(plan):
    transfer = plan["lmcache"]["transfer"]
    assert transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    env = plan["lmcache"]["env"]
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_LOCAL_CPU"] == "true"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "8"
    assert "class LMCacheConnectorV1(" in vllm_source("distributed/kv_transfer/kv_connector/v1/lmcache_connector.py")


def test_strata_connector_options_are_node_options(plan):
    transfer = plan["strata"]["transfer"]
    assert transfer["kv_connector"] == "StrataConnectorBase"
    assert transfer["kv_connector_module_path"] == "worker.dataplane.connectors.vllm"
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) == {"node_name", "tiers", "host_bytes", "host_pool_name", "status_port", "blend"}
    assert set(extra) <= {option.name for option in OPTIONS}
    config = load_config(overrides={**extra, "host_pool_name": "strata-gpu-bench-1"}, environ={})
    assert config.tiers == ("host",) and config.blend is False
    blending = plan["strata_blend"]["transfer"]["kv_connector_extra_config"]
    assert load_config(overrides={**blending, "host_pool_name": "strata-gpu-bench-1"}, environ={}).blend is True
    assert config.host_bytes == 8 * 2**30
    assert config.node_status_port == extra["status_port"]


def test_configs_choose_and_order_the_servers():
    assert list(planned("--configs", "strata,vllm")) == ["strata", "vllm"]


@pytest.mark.parametrize(("configs", "named"), [("vllm,nonsense", "nonsense"), ("vllm,vllm", "'vllm,vllm'")])
def test_configs_refuses_a_bad_list_naming_it(configs, named):
    done = script("plan", "--configs", configs)
    assert done.returncode == 2
    assert "--configs" in done.stderr
    assert named in done.stderr


def test_checks_refuse_to_pass_without_a_gpu():
    """`checks` runs the connector's CUDA tests; on a machine without CUDA it says so and fails,
    never passing on tests that were skipped."""
    done = script("checks", "--venv", sys.prefix)
    assert done.returncode == 1
    assert "torch sees no CUDA GPU here" in done.stdout + done.stderr
