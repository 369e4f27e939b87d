"""The demo refuses bad ports by name before it starts anything."""

import pytest

from controlplane.runtime import demo


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STRATA_HTTP_PORT": "http"}, "STRATA_HTTP_PORT: expected a TCP port number, got 'http'"),
        ({"STRATA_API_PORT": "70000"}, "STRATA_API_PORT: expected a TCP port number, got '70000'"),
        (
            {"STRATA_HTTP_PORT": "8100", "STRATA_API_PORT": "8100"},
            "STRATA_API_PORT: 8100 is the dashboard's port (STRATA_HTTP_PORT)",
        ),
    ],
)
def test_a_bad_port_is_refused_by_name_and_nothing_starts(monkeypatch, capsys, tmp_path, env, message):
    monkeypatch.delenv("STRATA_HTTP_PORT", raising=False)
    monkeypatch.delenv("STRATA_API_PORT", raising=False)
    monkeypatch.setenv("STRATA_VAR_DIR", str(tmp_path / "var"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr(demo, "run", lambda *args: started.append(args) or 0)
    assert demo.main(["run"]) == 2
    assert message in capsys.readouterr().err
    assert not started and not (tmp_path / "var").exists()


@pytest.mark.parametrize("value", ["sglang", "strata,vllm,vllm", "vllm,"])
def test_a_bad_demo_engine_is_refused_by_name_and_nothing_starts(monkeypatch, capsys, tmp_path, value):
    monkeypatch.setenv("STRATA_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("STRATA_DEMO_ENGINE", value)
    monkeypatch.setenv("STRATA_HTTP_PORT", "8100")
    monkeypatch.delenv("STRATA_API_PORT", raising=False)
    started = []
    monkeypatch.setattr(demo, "run", lambda *args: started.append(args) or 0)
    if value == "vllm,":  # a trailing comma is one name: every node serves with vLLM
        assert demo.main(["run"]) == 0 and started[0][3] == ["vllm", "vllm"]
        return
    assert demo.main(["run"]) == 2
    assert "STRATA_DEMO_ENGINE: expected strata or vllm, once or once per node" in capsys.readouterr().err
    assert not started


def test_demo_nodes_run_the_engines_asked_for():
    commands = dict(demo._procfile(8000, "bench", 9100, 8001, ["strata", "vllm"]))
    assert "--engine strata" in commands["gpu-0"] and "--serve-port 9100" in commands["gpu-0"]
    assert "--engine vllm" in commands["gpu-1"] and "--serve-port 9101" in commands["gpu-1"]


@pytest.mark.parametrize(
    ("engines", "blending", "port"), [(["strata", "strata"], "gpu-1", 9101), (["strata", "vllm"], "gpu-0", 9100)]
)
def test_one_demo_node_reuses_fragments_and_gets_the_rag_requests(engines, blending, port):
    commands = dict(demo._procfile(8000, "bench", 9100, 8001, engines))
    assert [name for name in demo.NODES if commands[name].startswith("STRATA_BLEND=true ")] == [blending]
    assert f"--rag-node http://127.0.0.1:{port}" in commands["workload"]
    assert "--rag-node" not in dict(demo._procfile(8000, "bench", 9100, 8001, ["vllm", "vllm"]))["workload"]
