"""Deployment files, checked statically (no Docker engine here), and production settings."""

import importlib.util
import json
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def _command(service) -> list[str]:
    command = service.get("command")
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def _check_project_command(argv: list[str]) -> None:
    """Every command of a Strata service must exist in this project."""
    from django.core.management import get_commands

    assert argv[0] == "python", argv
    if argv[1] == "manage.py":
        assert (REPO_ROOT / "manage.py").exists()
        assert argv[2] in get_commands(), f"no management command {argv[2]!r}"
        return
    assert argv[1] == "-m", argv
    module = argv[2]
    assert importlib.util.find_spec(module) is not None, f"module {module} not installed"
    if module == "daphne":
        app_module, _, attribute = argv[-1].partition(":")
        assert (REPO_ROOT / (app_module.replace(".", "/") + ".py")).exists()
        assert attribute == "application"
    elif module == "gunicorn":
        app_module, _, attribute = argv[-1].partition(":")
        assert (REPO_ROOT / (app_module.replace(".", "/") + ".py")).exists()
        assert attribute == "application"
        config = argv[argv.index("-c") + 1]
        assert config.startswith("python:"), config
        assert importlib.util.find_spec(config.removeprefix("python:")) is not None, config
    elif module == "celery":
        app_module = argv[argv.index("-A") + 1]
        assert (REPO_ROOT / (app_module.replace(".", "/") + ".py")).exists()
        assert argv[argv.index("-A") + 2] in {"worker", "beat"}


def test_every_service_command_exists(compose):
    services = compose["services"]
    assert {"postgres", "redis", "web", "api", "node-gpu-0", "beat"} <= set(services)
    for name, service in services.items():
        argv = _command(service)
        if "build" in service:
            _check_project_command(argv)
        elif service.get("profiles") == ["observability"]:
            assert service["image"].split(":")[0] in {"prom/prometheus", "grafana/grafana"}, name
        else:
            assert service["image"].split(":")[0] in {"postgres", "redis"}, name
            assert argv[0] in {"postgres", "redis-server"}, name


def test_dockerfile_and_its_sources_exist(compose):
    build = compose["services"]["web"]["build"]
    dockerfile = REPO_ROOT / build["context"] / build["dockerfile"]
    assert dockerfile.exists()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:  # --from copies out of an earlier stage
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_data_services_are_durable_and_checked(compose):
    services = compose["services"]
    assert "--data-checksums" in services["postgres"]["environment"]["POSTGRES_INITDB_ARGS"]
    assert "--appendonly" in _command(services["redis"])
    for name in ("postgres", "redis", "web", "node-gpu-0"):
        assert "healthcheck" in services[name], name
    assert "pgdata" in compose["volumes"] and "redisdata" in compose["volumes"]
    gpu = services["node-gpu-0"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_production_settings_pass_check_deploy(tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.prod",
            "STRATA_SECRET_KEY": secrets.token_urlsafe(64),
            "STRATA_ALLOWED_HOSTS": "strata.example.com",
            "STRATA_VAR_DIR": str(tmp_path),
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"System check identified no issues", result.stdout + result.stderr)


def test_production_refuses_a_weak_secret(tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.prod",
            "STRATA_SECRET_KEY": "short",
            "STRATA_VAR_DIR": str(tmp_path),
        },
    )
    assert result.returncode != 0
    assert (
        result.stderr.strip() == "strata: STRATA_SECRET_KEY: production needs a random secret of at least 50 characters"
    )


def test_readme_documents_every_node_option():
    from worker.dataplane.config import describe_options

    readme = (REPO_ROOT / "README.md").read_text()
    missing = [row["variable"] for row in describe_options() if f"`{row['variable']}`" not in readme]
    assert not missing, f"README lacks {missing}"


def test_the_image_installs_the_dashboards_npm_packages_from_the_lockfile():
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    assert "npm ci" in dockerfile and "frontend/package-lock.json" in dockerfile
    assert "COPY --from=assets /frontend/node_modules frontend/node_modules" in dockerfile
    lock = json.loads((REPO_ROOT / "frontend" / "package-lock.json").read_text())
    package = json.loads((REPO_ROOT / "frontend" / "package.json").read_text())
    for name, version in package["dependencies"].items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version, f"{name} not pinned in the lockfile"


def test_observability_profile_scrapes_the_control_plane_and_the_nodes(compose):
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == ["observability"] and grafana["profiles"] == ["observability"]
    mounts = {m.split(":")[0]: m.split(":")[1] for m in prometheus["volumes"] if m.startswith("./")}
    assert mounts["./deploy/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert f"--config.file={mounts['./deploy/prometheus.yml']}" in prometheus["command"]
    for mount in grafana["volumes"]:
        if mount.startswith("./"):
            assert (REPO_ROOT / mount.split(":")[0]).exists(), mount
    assert {"promdata", "grafanadata"} <= set(compose["volumes"])
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    web_port = services["web"]["command"][services["web"]["command"].index("-p") + 1]
    assert jobs["strata-controlplane"]["static_configs"][0]["targets"] == [f"web:{web_port}"]
    discovery = jobs["strata-nodes"]["http_sd_configs"][0]["url"]
    assert discovery == f"http://web:{web_port}/metrics/nodes"
    # The node's engine server listens where the control plane tells Prometheus to look.
    node_env = services["node-gpu-0"]["environment"]
    assert node_env["STRATA_NODE_ADDRESS"] == f"node-gpu-0:{node_env['STRATA_SERVE_PORT']}"
    assert node_env["STRATA_SERVE_HOST"] == "0.0.0.0"
    datasource = yaml.safe_load(
        (REPO_ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "strata.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {datasource["datasources"][0]["uid"]}


def test_the_nodes_and_the_control_plane_share_the_node_admin_key(compose):
    services = compose["services"]
    for name in ("web", "node-gpu-0", "node-vllm"):
        assert services[name]["environment"]["STRATA_NODE_ADMIN_KEY"].startswith("${STRATA_NODE_ADMIN_KEY:?"), name


def test_the_nodes_run_on_their_own_database_credentials(compose):
    services = compose["services"]
    command = _command(services["node-credentials"])
    assert command[:3] == ["python", "manage.py", "strata_node_credential"] and "--url-dir" in command
    folder = command[command.index("--url-dir") + 1]
    for name, node in (("node-gpu-0", "gpu-0"), ("node-vllm", "gpu-vllm")):
        service = services[name]
        assert node in command and _command(service)[_command(service).index("--name") + 1] == node
        assert "DATABASE_URL" not in service["environment"], name  # not the control plane's credential
        assert service["environment"]["DATABASE_URL_FILE"] == f"{folder}/{node}.url"
        assert f"credentials:{folder}:ro" in service["volumes"]
        assert service["depends_on"]["node-credentials"]["condition"] == "service_completed_successfully"
