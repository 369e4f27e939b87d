"""A running Strata for the browser tests, and Debian's Chromium driven by Playwright.

The system is real and separate from pytest-django's test database: a database of its own on the
test PostgreSQL (migrated by `manage.py migrate`), Redis databases of their own, daphne serving
controlplane.asgi (HTTP and the websocket), and a node worker process serving the tiny model, which
heartbeats, writes blocks, reuses fragments and executes movements. The tests read what they check through the same
REST API the pages use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.support import free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOTS = REPO_ROOT / "var" / "artifacts" / "screenshots"
REDIS_BASE_DB = 9
"""The system's Redis databases: 9 (Celery), 10 (channel layer, sequence numbers), 11 (cache)."""
PASSWORDS = {"admin": "browser-admin-pw-1", "operator": "browser-operator-pw-1", "viewer": "browser-viewer-pw-1"}
NODE = "browser-node"
BLEND_NAMESPACE = "browser-rag"

CREATE_USERS = """
from django.contrib.auth.models import Group, User
from controlplane.accounts.services import roles_ensure
roles_ensure()
for name, password in {passwords}.items():
    user = User.objects.create_user(username=name, password=password, is_staff=name == "admin",
                                    is_superuser=name == "admin")
    user.groups.add(Group.objects.get(name=name))
"""


@dataclass
class System:
    base: str
    node_api: str
    env: dict[str, str]
    var_dir: Path
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def manage(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        log_path = self.var_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, cwd=REPO_ROOT, env={**self.env, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT
            )
        self.processes.append((name, process, log_path))

    def log_tail(self, name: str, chars: int = 4000) -> str:
        for pname, _, path in self.processes:
            if pname == name:
                return path.read_text(errors="replace")[-chars:]
        return ""


class Api:
    """The REST API as one user sees it (token auth, so no CSRF dance)."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.token = token

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Token {self.token}",
                "Accept": "application/json",
                **({"Content-Type": "application/json"} if data is not None else {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                text = response.read()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as exc:
            text = exc.read()
            return exc.code, json.loads(text) if text else None

    def get(self, path: str) -> Any:
        status, body = self.call("GET", path)
        assert status == 200, (path, status, body)
        return body


def _database_url(name: str) -> tuple[str, dict[str, Any]]:
    from controlplane.runtime.environment import load_environment

    db = load_environment().database
    params = {"user": db.user, "password": db.password, "host": db.host, "port": db.port}
    if db.host.startswith("/"):
        url = f"postgresql://{db.user}:{db.password}@/{name}?host={db.host}" + (f"&port={db.port}" if db.port else "")
    else:
        url = f"postgresql://{db.user}:{db.password}@{db.host}:{db.port or 5432}/{name}"
    return url, params


def _admin_connection(params: dict[str, Any]) -> psycopg.Connection[Any]:
    return psycopg.connect(dbname="postgres", autocommit=True, **{k: v for k, v in params.items() if v})


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    from controlplane.runtime.environment import load_environment

    name = f"strata_browser_{uuid.uuid4().hex[:8]}"
    url, params = _database_url(name)
    with _admin_connection(params) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    redis_env = load_environment().redis
    var_dir = Path(tempfile.mkdtemp(prefix="strata-browser-"))
    port, node_port = free_port(), free_port()
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": redis_env.url_for_db(REDIS_BASE_DB),
        "STRATA_VAR_DIR": str(var_dir),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
        "PYTHONUNBUFFERED": "1",
        "STRATA_LOG_LEVEL": "INFO",
        # The node requires it on its request timelines; the control plane (daphne) reads them with it.
        "STRATA_NODE_ADMIN_KEY": f"browser-admin-{uuid.uuid4().hex}",
    }
    system = System(base=f"http://127.0.0.1:{port}", node_api=f"http://127.0.0.1:{node_port}", env=env, var_dir=var_dir)
    pool = f"strata-test-{NODE}-{uuid.uuid4().hex[:6]}"
    try:
        system.manage("migrate", "--noinput", "-v", "0")
        system.manage("collectstatic", "--noinput", "-v", "0")
        system.manage("shell", "-c", CREATE_USERS.format(passwords=repr(PASSWORDS)))
        system.start(
            "daphne",
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
        )
        # The node on its own credential, as `strata_node_credential` prints it.
        printed = system.manage("strata_node_credential", NODE).splitlines()
        credential = next(line for line in printed if line.startswith("DATABASE_URL=")).split("=", 1)[1]
        admin_key = next(line for line in printed if line.startswith("STRATA_NODE_ADMIN_KEY=")).split("=", 1)[1]
        system.start(
            "node",
            [
                sys.executable,
                "manage.py",
                "strata_node",
                "--name",
                NODE,
                "--heartbeat-seconds",
                "0.5",
                "--model",
                "tiny",
                "--serve-port",
                str(node_port),
                "--disk-path",
                str(var_dir / "disk"),
                "--disk-bytes",
                "64MiB",
            ],
            {
                "DATABASE_URL": credential,
                "STRATA_NODE_ADMIN_KEY": admin_key,  # its own: the control plane reads it with this one
                "STRATA_HOST_POOL_NAME": pool,
                "STRATA_BLOCK_TOKENS": "16",
                "STRATA_HOST_BYTES": "64MiB",
                "STRATA_DEVICE_BYTES": "8MiB",
                "STRATA_TIERS": "device,host,disk",
                # Fragment reuse on, with one namespace's r set for this model by a fleet-wide entry.
                "STRATA_BLEND": "true",
                "STRATA_BLEND_SAMPLE_RATE": "0",
                "STRATA_BLEND_NAMESPACE_PERCENT": f"tiny/{BLEND_NAMESPACE}=25,other-model/{BLEND_NAMESPACE}=90",
            },
        )
        wait_for(
            lambda: _answers(system.base + "/livez"),
            timeout=60,
            what=f"daphne at {system.base}\n{system.log_tail('daphne')}",
        )
        wait_for(
            lambda: _answers(system.node_api + "/v1/models"),
            timeout=180,
            what=f"the node's engine server\n{system.log_tail('node')}",
        )
        yield system
    finally:
        for _name, process, _ in reversed(system.processes):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for pname, _, path in system.processes:
            print(f"--- {pname} log (tail) ---\n{path.read_text(errors='replace')[-3000:]}")
        for shm in Path("/dev/shm").glob(f"{pool}*"):
            shm.unlink(missing_ok=True)
        with _admin_connection(params) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            # The node roles named after this database (roles outlive it: they belong to the server).
            roles = connection.execute("SELECT rolname FROM pg_roles WHERE starts_with(rolname, %s)", [name + "_"])
            for (role,) in roles.fetchall():
                connection.execute(f'DROP ROLE IF EXISTS "{role}"')
        for db in range(REDIS_BASE_DB, REDIS_BASE_DB + 3):
            client = redis.Redis.from_url(redis_env.url_for_db(db))
            client.flushdb()
            client.close()
        shutil.rmtree(var_dir, ignore_errors=True)


def _token(system: System, username: str) -> str:
    out = system.manage("drf_create_token", username)
    return out.strip().split()[2]


@pytest.fixture(scope="module")
def apis(system: System) -> dict[str, Api]:
    return {name: Api(system.base, _token(system, name)) for name in PASSWORDS}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module scope: Playwright's sync API keeps an event loop running in this thread while it is
    # open, and Django refuses database calls from a thread with a running loop (later tests).
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: run `make setup` (it installs Debian's chromium "
            "package when it is missing), or `apt-get install -y chromium`.",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def login(system: System, browser: Any) -> Iterator[Any]:
    """Open a logged-in page for a user, through the login form; every context closes after the test."""
    contexts = []

    def open_as(username: str, *, width: int = 1280, height: int = 900, color_scheme: str = "light") -> Any:
        context = browser.new_context(viewport={"width": width, "height": height}, color_scheme=color_scheme)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(15000)
        page.goto(system.base + "/")
        assert "/accounts/login/" in page.url
        page.get_by_label("User name").fill(username)
        page.get_by_label("Password").fill(PASSWORDS[username])
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(system.base + "/")
        return page

    yield open_as
    for context in contexts:
        context.close()


@pytest.fixture(scope="module")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


def wait_until(page: Any, expression: str, timeout: float = 15000) -> None:
    """Poll the JavaScript `expression` in the page until it is truthy, failing after `timeout` ms.
    page.evaluate runs outside the page's Content-Security-Policy; Playwright's wait_for_function
    evaluates a string predicate with eval, which the dashboard's policy (no 'unsafe-eval') refuses."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} ms waiting for {expression}")
        page.wait_for_timeout(25)


def live(page: Any, timeout: float = 10000) -> None:
    """Wait until the page's stream has loaded its snapshot and is applying events."""
    wait_until(page, "document.body.dataset.streamState === 'live'", timeout=timeout)


def now() -> float:
    return time.monotonic()
