"""Deployment files, checked statically (no Docker engine here), and production settings."""

import json
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.commands import check_strata_command
from tests.deploy.sizing import compose_size_at_least, shm_bytes_needed, strata_size

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_SERVICES = ("node-gpu-0", "node-vllm")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def _command(service) -> list[str]:
    command = service.get("command")
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def _dockerfile(service) -> Path:
    build = service["build"]
    return REPO_ROOT / build["context"] / build["dockerfile"]


def test_every_service_command_exists(compose):
    services = compose["services"]
    assert {"postgres", "redis", "web", "api", "control-worker", "beat", "node-gpu-0", "node-vllm"} <= set(services)
    for name, service in services.items():
        argv = _command(service)
        if "build" in service:
            check_strata_command(argv)
        elif service.get("profiles") == ["observability"]:
            assert service["image"].split(":")[0] in {"prom/prometheus", "grafana/grafana"}, name
        else:
            assert service["image"].split(":")[0] in {"postgres", "redis"}, name
            assert argv[0] in {"postgres", "redis-server"}, name


def test_the_servers_listen_where_compose_publishes_them(compose):
    services = compose["services"]
    web = check_strata_command(_command(services["web"]))
    assert web[web.index("-p") + 1] == "8000" and services["web"]["ports"] == ["8000:8000"]
    api = check_strata_command(_command(services["api"]))
    assert api[api.index("-b") + 1] == "0.0.0.0:8001" and services["api"]["ports"] == ["8001:8001"]
    worker = check_strata_command(_command(services["control-worker"]))
    assert worker[worker.index("-Q") + 1] == "control"


def test_dockerfiles_and_their_sources_exist(compose):
    dockerfiles = {_dockerfile(service) for service in compose["services"].values() if "build" in service}
    assert dockerfiles == {REPO_ROOT / "deploy" / "Dockerfile", REPO_ROOT / "deploy" / "Dockerfile.node-gpu"}
    for dockerfile in dockerfiles:
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:  # --from copies out of an earlier stage
                for source in line.split()[1:-1]:
                    assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"


def test_the_control_plane_image_runs_as_a_fixed_unprivileged_user():
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    final_stage = dockerfile[dockerfile.rindex("\nFROM ") :]
    users = re.findall(r"^USER (\S+)$", final_stage, re.MULTILINE)
    assert users == ["10001:10001"], users  # numeric, so Kubernetes' runAsNonRoot can verify it
    assert re.search(r"useradd --system --uid 10001 --gid 10001 ", final_stage)
    # Static files are collected at build, before USER: the server never writes them.
    assert final_stage.index("strata manage collectstatic --noinput") < final_stage.index("USER ")
    assert re.search(r'^CMD \["strata", "web"\]$', final_stage, re.MULTILINE)


def test_the_gpu_node_image_keeps_vllms_cuda_torch():
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile.node-gpu").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.0$", dockerfile, re.MULTILINE)
    assert dockerfile.rstrip().splitlines()[-1] == 'CMD ["strata", "node", "--engine", "vllm"]'
    assert "\nFROM ${VLLM_IMAGE}\n" in dockerfile
    # Every package of the image, torch and vllm included, pinned as a constraint of the install.
    assert "pip list --format=freeze > /tmp/vllm-image.txt" in dockerfile
    assert "pip install -c /tmp/vllm-image.txt '.[gpu,vllm]'" in dockerfile
    assert "ENTRYPOINT []" in dockerfile  # vLLM's own entrypoint would start a server without the node
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r"^gpu = \[\n  \"kvikio-cu12==", pyproject, re.MULTILINE)


def test_gpu_nodes_run_the_cuda_image(compose):
    services = compose["services"]
    for name in NODE_SERVICES:
        assert _dockerfile(services[name]) == REPO_ROOT / "deploy" / "Dockerfile.node-gpu", name
        assert services[name]["image"] == "strata-node-gpu:latest", name
        assert _command(services[name])[:2] == ["strata", "node"], name
    for name, service in services.items():
        if "build" in service and name not in NODE_SERVICES:
            assert _dockerfile(service) == REPO_ROOT / "deploy" / "Dockerfile", name


def test_each_nodes_host_pool_fits_its_shm(compose):
    nodes = {name: s for name, s in compose["services"].items() if "STRATA_HOST_BYTES" in s.get("environment", {})}
    assert set(nodes) == set(NODE_SERVICES)
    for name, service in nodes.items():
        host = strata_size(service["environment"]["STRATA_HOST_BYTES"])
        shm = compose_size_at_least(service["shm_size"])
        needed = shm_bytes_needed(host)
        assert needed <= shm, f"{name}: a {host}-byte host pool needs {needed} bytes of /dev/shm, shm_size is {shm}"


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


def test_the_images_install_the_dashboards_npm_packages_from_the_lockfile():
    for name in ("Dockerfile", "Dockerfile.node-gpu"):
        dockerfile = (REPO_ROOT / "deploy" / name).read_text()
        assert "npm ci" in dockerfile and "COPY frontend/package.json frontend/package-lock.json ./" in dockerfile
        assert "COPY --from=assets /src/frontend/node_modules frontend/node_modules" in dockerfile, name
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
    for mount in grafana["volumes"] + prometheus["volumes"]:
        if mount.startswith("./"):
            assert (REPO_ROOT / mount.split(":")[0]).exists(), mount
    assert {"promdata", "grafanadata"} <= set(compose["volumes"])
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus.yml").read_text())
    # The alert rules are loaded from where compose mounts them.
    assert config["rule_files"] == [mounts["./deploy/prometheus/alerts.yml"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    web = check_strata_command(_command(services["web"]))
    web_port = web[web.index("-p") + 1]
    assert jobs["strata-controlplane"]["static_configs"][0]["targets"] == [f"web:{web_port}"]
    discovery = jobs["strata-nodes"]["http_sd_configs"][0]["url"]
    assert discovery == f"http://web:{web_port}/metrics/nodes"
    # The node's engine server listens where the control plane tells Prometheus to look.
    node_env = services["node-gpu-0"]["environment"]
    assert node_env["STRATA_NODE_ADDRESS"] == f"node-gpu-0:{node_env['STRATA_SERVE_PORT']}"
    assert node_env["STRATA_SERVE_HOST"] == "0.0.0.0"
    vllm_env = services["node-vllm"]["environment"]
    assert vllm_env["STRATA_NODE_ADDRESS"] == f"node-vllm:{vllm_env['STRATA_STATUS_PORT']}"
    datasource = yaml.safe_load(
        (REPO_ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "strata.json").read_text())
    # Panels follow the dashboard's datasource variable, which starts on the provisioned Prometheus.
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == datasource["datasources"][0]["uid"]
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {"${" + variable["name"] + "}"}


def test_each_node_runs_with_its_own_admin_key_beside_its_credential(compose):
    services = compose["services"]
    assert services["web"]["environment"]["STRATA_NODE_ADMIN_KEY"].startswith("${STRATA_NODE_ADMIN_KEY:?")
    for name in NODE_SERVICES:
        environment = services[name]["environment"]
        assert "STRATA_NODE_ADMIN_KEY" not in environment, name  # the fleet-wide key is the control plane's
        url_file = environment["DATABASE_URL_FILE"]
        assert environment["STRATA_NODE_ADMIN_KEY_FILE"] == url_file.removesuffix(".url") + ".admin.key", name


def test_the_nodes_run_on_their_own_database_credentials(compose):
    services = compose["services"]
    command = _command(services["node-credentials"])
    assert command[:2] == ["strata", "credential"] and "--url-dir" in command
    folder = command[command.index("--url-dir") + 1]
    # The control-plane image runs as uid 10001: the credentials volume is mounted on the
    # directory the image made for it, so the new volume is that user's and it can write there.
    assert services["node-credentials"]["volumes"] == [f"credentials:{folder}"]
    assert (
        f"install -d -o strata -g strata -m 0750 /var/lib/strata {folder}"
        in (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    )
    for name, node in (("node-gpu-0", "gpu-0"), ("node-vllm", "gpu-vllm")):
        service = services[name]
        assert node in command and _command(service)[_command(service).index("--name") + 1] == node
        assert "DATABASE_URL" not in service["environment"], name  # not the control plane's credential
        assert service["environment"]["DATABASE_URL_FILE"] == f"{folder}/{node}.url"
        assert "REDIS_URL" not in service["environment"], name  # nor the control plane's Redis user
        assert service["environment"]["REDIS_URL_FILE"] == f"{folder}/{node}.redis.url"
        assert f"credentials:{folder}:ro" in service["volumes"]
        assert service["depends_on"]["node-credentials"]["condition"] == "service_completed_successfully"


def test_compose_redis_needs_a_password_and_never_evicts(compose):
    services = compose["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1].startswith("${STRATA_REDIS_PASSWORD:?")
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert services["web"]["environment"]["REDIS_URL"].startswith("redis://:${STRATA_REDIS_PASSWORD:?")
    assert "${STRATA_REDIS_PASSWORD}" in services["redis"]["healthcheck"]["test"]
