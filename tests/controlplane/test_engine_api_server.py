"""The engine API server (gunicorn with `controlplane.runtime.gunicorn`), started as docker-compose
and the demo start it. The demo's integration test reads the API through it with a session; the
directory bench times token lookups through it."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "gunicorn", "-c", "python:controlplane.runtime.gunicorn"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test", "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("STRATA_API_WORKERS", "two", "STRATA_API_WORKERS: expected a whole number, got 'two'"),
        ("STRATA_API_THREADS", "0", "STRATA_API_THREADS: must be at least 1, got 0"),
        ("STRATA_API_TIMEOUT_S", "-5", "STRATA_API_TIMEOUT_S: must be at least 1, got -5"),
    ],
)
def test_a_bad_setting_stops_the_server_naming_it(variable, value, message):
    started = subprocess.run(
        [*COMMAND, "-b", f"127.0.0.1:{free_port()}", "controlplane.wsgi:application"],
        cwd=REPO_ROOT,
        env=_env(**{variable: value}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode != 0
    assert message in started.stderr


def test_the_server_answers_and_asks_engines_for_a_token():
    port = free_port()
    server = subprocess.Popen(
        [*COMMAND, "-b", f"127.0.0.1:{port}", "controlplane.wsgi:application"],
        cwd=REPO_ROOT,
        env=_env(STRATA_API_WORKERS="1", STRATA_API_THREADS="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                with urllib.request.urlopen(base + "/livez", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the engine API server did not answer /livez in 60 s"
                time.sleep(0.2)
        request = urllib.request.Request(
            base + "/api/v1/blocks/lookup/",
            data=b'{"prefix_keys": []}',
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"] == "Token"
        assert "credentials" in json.loads(refused.value.read())["detail"]
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert "Strata engine API ready on" in output and "1 workers x 2 threads" in output
