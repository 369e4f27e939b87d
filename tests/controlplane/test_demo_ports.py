"""The demo refuses bad ports by name before it starts anything."""

import pytest

from controlplane.runtime import demo


@pytest.mark.parametrize(("env", "message"), [
    ({"STRATA_HTTP_PORT": "http"}, "STRATA_HTTP_PORT: expected a TCP port number, got 'http'"),
    ({"STRATA_API_PORT": "70000"}, "STRATA_API_PORT: expected a TCP port number, got '70000'"),
    ({"STRATA_HTTP_PORT": "8100", "STRATA_API_PORT": "8100"},
     "STRATA_API_PORT: 8100 is the dashboard's port (STRATA_HTTP_PORT)"),
])
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
