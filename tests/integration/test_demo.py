"""`make demo` end to end in a private var/ directory: embedded PostgreSQL and Redis, daphne, two node
workers, beat; /readyz is 200, both nodes are listed to the admin; `stop` leaves no process behind."""

import hashlib
import http.cookiejar
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _processes_of(var_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.pid == os.getpid():
                continue
            environ = process.environ()
            cmdline = " ".join(process.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if environ.get("STRATA_VAR_DIR") == str(var_dir) or str(var_dir) in cmdline:
            found.append(process)
    return found


class Session:
    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str, *, attempts: int = 5) -> tuple[int, bytes]:
        """The status and body of GET `path`; a refused or dropped connection is tried again, up to
        `attempts` times a second apart (a loaded machine may be restarting a worker)."""
        for attempt in range(attempts):
            try:
                with self.opener.open(self.base + path, timeout=10) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except OSError:
                if attempt == attempts - 1:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def login(self, username: str, password: str) -> None:
        self.get("/accounts/login/")
        token = next(c.value for c in self.jar if c.name == "csrftoken")
        data = urllib.parse.urlencode({"username": username, "password": password, "csrfmiddlewaretoken": token})
        request = urllib.request.Request(
            self.base + "/accounts/login/", data=data.encode(), headers={"Referer": self.base + "/accounts/login/"}
        )
        with self.opener.open(request, timeout=10) as response:
            assert response.status == 200
        assert any(c.name == "sessionid" for c in self.jar), "login failed"


@pytest.fixture
def var_dir():
    # Not under pytest's temp root: pytest closes that to 0700 again whenever a session starts, and
    # the embedded PostgreSQL runs as its own system user.
    path = Path(tempfile.mkdtemp(prefix="strata-demo-test-"))
    yield path / "var"
    shutil.rmtree(path, ignore_errors=True)


def _why_down(demo: subprocess.Popen, log) -> str:
    """What the demo's supervisor said about its processes' exits (it stops them all when one
    ends), for a failure message: the log's last lines that tell why."""
    log.flush()
    log.seek(0)
    lines = log.read().splitlines()
    telling = [line for line in lines if any(w in line for w in ("exited", "Error", "error", "Traceback", "refus"))]
    return f"the demo's exit code: {demo.poll()}; its log says:\n" + "\n".join(telling[-40:] or lines[-40:])


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def node_ports(taken: tuple[int, ...]) -> int:
    """The demo's first node port: both nodes' serve ports (it and the next) and their status
    ports (each + 1000) free, and none of them one of `taken`."""
    for _ in range(200):
        first = free_port()
        ports = (first, first + 1, first + 1000, first + 1001)
        if ports[-1] < 65536 and not set(ports) & set(taken) and all(_bindable(p) for p in ports[1:]):
            return first
    raise AssertionError("no four free ports for the demo's nodes")


def test_demo_serves_both_nodes_and_stop_leaves_nothing(tmp_path, var_dir):
    port = free_port()
    api_port = free_port()
    while api_port == port:
        api_port = free_port()
    node_port = node_ports((port, api_port))
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    pools = "strata-" + hashlib.sha256(str(var_dir.resolve()).encode()).hexdigest()[:8]
    env.update(
        STRATA_VAR_DIR=str(var_dir),
        STRATA_HTTP_PORT=str(port),
        STRATA_API_PORT=str(api_port),
        PYTHONUNBUFFERED="1",
        STRATA_DEMO_MODEL="tiny",
        STRATA_DEMO_NODE_PORT=str(node_port),
        STRATA_HEARTBEAT_SECONDS="1",
    )
    log = open(tmp_path / "demo.log", "w+")
    demo = subprocess.Popen(
        [sys.executable, "-m", "controlplane.runtime.demo", "run"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        session = Session(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and demo.poll() is None:
            try:
                status, _ = session.get("/readyz", attempts=1)
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, f"readyz never 200 (last {status}); {_why_down(demo, log)}"
        password = (var_dir / "admin-password").read_text().strip()
        session.login("admin", password)
        names: set[str] = set()
        while time.monotonic() < deadline and names != {"gpu-0", "gpu-1"}:
            code, body = session.get("/api/v1/nodes/")
            assert code == 200
            names = {n["name"] for n in json.loads(body)["results"] if n["state"] == "up"}
            time.sleep(0.5)
        assert names == {"gpu-0", "gpu-1"}
        # The engine API: the same REST API on the WSGI server (the session works there too).
        engine_api = Session(f"http://127.0.0.1:{api_port}")
        engine_api.opener = session.opener
        code, body = engine_api.get("/api/v1/nodes/")
        assert code == 200 and {n["name"] for n in json.loads(body)["results"]} >= {"gpu-0", "gpu-1"}
        assert session.get("/api/docs/")[0] == 200
        assert session.get("/")[0] == 200
        assert _processes_of(var_dir), "the demo's processes should be visible while it runs"
        # The workload driver keeps the node servers busy: requests show up in a node's timeline,
        # which only the node's own admin key reads; the control plane reads it with that key.
        node_api = Session(f"http://127.0.0.1:{node_port}")
        admin_key = (var_dir / "credentials" / "gpu-0.admin.key").read_text().strip()
        node_api.opener.addheaders = [("Authorization", f"Bearer {admin_key}")]
        served = []
        while time.monotonic() < deadline and not served:
            try:
                code, body = node_api.get("/v1/strata/requests")
                served = json.loads(body)["requests"] if code == 200 else []
            except OSError:
                pass
            time.sleep(0.5)
        assert served, "no request reached the first node"
        assert Session(f"http://127.0.0.1:{node_port}").get("/v1/strata/requests")[0] == 401
        code, body = session.get("/api/v1/requests/?node=gpu-0")
        assert code == 200 and json.loads(body)["requests"], json.loads(body)["nodes"]
        # gpu-1 reuses fragments and gets the RAG requests: the overview's fragment reuse moves.
        reused = 0.0
        rag_deadline = time.monotonic() + 120
        while time.monotonic() < rag_deadline and not reused:
            code, body = session.get("/api/v1/dashboard/cache/?node=gpu-1")
            reuse = json.loads(body)["fragment_reuse"] if code == 200 else {}
            reused = reuse.get("reused_tokens", {}).get("fragment", 0.0)
            if not reused:
                time.sleep(1)
        assert reused > 0, "the RAG requests to gpu-1 reused no fragment"
        assert reuse["nodes"] == [
            {"node": "gpu-1", "model": "tiny", "enabled": True, "default_recompute_percent": 15.0}
        ]

        stop = subprocess.run(
            [sys.executable, "-m", "controlplane.runtime.demo", "stop"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert stop.returncode == 0, stop.stderr
        demo.wait(30)
        left = []
        for _ in range(50):
            left = _processes_of(var_dir)
            if not left:
                break
            time.sleep(0.2)
        assert not left, (stop.stdout, [p.info["cmdline"] for p in left])
        # The nodes' shared-memory pools go with the demo: nothing is left holding memory.
        assert "host-tier pools removed from /dev/shm" in stop.stdout
        assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(pools)]
    except OSError as exc:
        # A request that finds nothing listening: say which process ended the demo, and why.
        raise AssertionError(f"{exc}; {_why_down(demo, log)}") from exc
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        for process in _processes_of(var_dir):
            process.kill()
        for pool in Path("/dev/shm").glob(pools + "-*"):
            pool.unlink(missing_ok=True)
        log.seek(0)
        print(log.read()[-6000:])
        log.close()
