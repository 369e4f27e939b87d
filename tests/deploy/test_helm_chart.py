"""The Helm chart (deploy/helm/strata), rendered by Helm's own engine (helm-python-sdk binds Helm's
Go SDK) and every object validated against the Kubernetes API's schemas (kubernetes-validate)."""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.deploy.commands import check_strata_command
from tests.deploy.metric_names import REPO_ROOT
from tests.deploy.sizing import kubernetes_quantity, shm_bytes_needed, strata_size

CHART = REPO_ROOT / "deploy" / "helm" / "strata"
EXTERNAL_VALUES = REPO_ROOT / "deploy" / "helm" / "values-external.yaml"
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())  # the chart's kubeVersion floor, the newest
OPERATOR_FLAGS = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
CONTROL_PLANE = ("web", "api", "control-worker", "beat")
IMAGE_UID = 10001  # deploy/Dockerfile's USER
GRANTS = (
    "manage shell -c from controlplane.directory.services.credentials import node_grants_apply; node_grants_apply()"
)


def render(values: dict | None = None) -> list[dict]:
    manifests = helm_python.Chart.load(CHART).render(values=values or {}, name="strata", namespace="serving")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind_and_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def containers(obj: dict) -> Iterator[dict]:
    spec = obj["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


@pytest.fixture(scope="module")
def trying_it_out() -> dict:
    return by_kind_and_name(render(OPERATOR_FLAGS | {"grafanaDashboard": {"enabled": True}}))


@pytest.fixture(scope="module")
def fleet() -> dict:
    return by_kind_and_name(render(yaml.safe_load(EXTERNAL_VALUES.read_text())))


def test_the_chart_lints_clean():
    for values in ({}, yaml.safe_load(EXTERNAL_VALUES.read_text())):
        report = helm_python.lint(CHART, values, strict=True)
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # no warnings


@pytest.mark.parametrize("values", ["defaults", "external"])
def test_every_object_is_valid_for_the_kubernetes_api(values):
    objects = render(yaml.safe_load(EXTERNAL_VALUES.read_text()) if values == "external" else OPERATOR_FLAGS)
    operator_kinds = {"ServiceMonitor", "PrometheusRule"}
    checked = set()
    for obj in objects:
        if obj["kind"] in operator_kinds:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue  # custom resources: their schema is the Prometheus Operator's (checked below)
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)  # unknown fields fail too
        checked.add(obj["kind"])
    assert {"Deployment", "Service", "StatefulSet", "Job", "ServiceAccount", "Role", "RoleBinding"} <= checked


def test_the_control_plane_runs_each_strata_command_as_the_images_user(trying_it_out):
    for component in CONTROL_PLANE:
        deployment = trying_it_out["Deployment", f"strata-{component}"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID == pod["securityContext"]["runAsGroup"]
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert container["command"][:2] == ["strata", component]
        check_strata_command(container["command"])
        env = env_of(container)
        assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "strata-postgresql", "key": "database-url"}
        # The kubelet's probes and Prometheus address the pod by its IP.
        assert env["STRATA_ALLOWED_HOSTS"]["value"].startswith("$(POD_IP),")
        assert list(env).index("POD_IP") < list(env).index("STRATA_ALLOWED_HOSTS")


@pytest.mark.parametrize("component, option", [("web", "-p"), ("api", "-b")])
def test_the_servers_listen_on_their_services_ports(trying_it_out, component, option):
    (container,) = trying_it_out["Deployment", f"strata-{component}"]["spec"]["template"]["spec"]["containers"]
    server = check_strata_command(container["command"])
    port = int(server[server.index(option) + 1].rpartition(":")[2])
    assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    service = trying_it_out["Service", f"strata-{component}"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert (
        service["spec"]["selector"]
        == trying_it_out["Deployment", f"strata-{component}"]["spec"]["selector"]["matchLabels"]
    )
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_beat_is_one_and_never_two(trying_it_out):
    beat = trying_it_out["Deployment", "strata-beat"]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"] == {"type": "Recreate"}


def test_migrations_run_before_upgrades_and_credentials_after_them(trying_it_out):
    migrate = trying_it_out["Job", "strata-migrate"]
    credentials = trying_it_out["Job", "strata-node-credentials"]
    assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    assert credentials["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    weight = lambda job: int(job["metadata"]["annotations"]["helm.sh/hook-weight"])  # noqa: E731
    assert weight(migrate) < weight(credentials)
    assert [c["command"] for c in containers(migrate)] == [["strata", "migrate"]]


def test_the_node_runs_vllm_with_strata_on_a_gpu(trying_it_out):
    statefulset = trying_it_out["StatefulSet", "strata-node"]
    pod = statefulset["spec"]["template"]
    (node,) = pod["spec"]["containers"]
    assert node["image"] == "strata-node-gpu:0.1.0"
    assert node["command"][:4] == ["strata", "node", "--engine", "vllm"]
    check_strata_command(node["command"])
    for bound in ("requests", "limits"):
        assert node["resources"][bound]["nvidia.com/gpu"] == 1
    env = env_of(node)
    assert env["STRATA_NODE_NAME"]["value"] == "$(POD_NAME)"
    assert env["STRATA_SERVE_HOST"]["value"] == "0.0.0.0"
    assert "DATABASE_URL" not in env  # never the control plane's credential
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert env["STRATA_SERVE_PORT"]["value"] == str(ports["openai"])
    assert env["STRATA_STATUS_PORT"]["value"] == str(ports["status"])
    # The control plane reaches the node, and Prometheus scrapes it, on its Strata endpoints.
    assert env["STRATA_NODE_ADDRESS"]["value"] == f"$(POD_NAME).strata-node.$(POD_NAMESPACE).svc:{ports['status']}"
    assert trying_it_out["Service", "strata-node"]["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == "strata-node"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(ports["status"])
    mounts = {m["name"]: m for m in node["volumeMounts"]}
    assert mounts["nvme"]["mountPath"] == node["command"][node["command"].index("--disk-path") + 1]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["nvme"]["hostPath"]["path"] == "/mnt/nvme/strata"
    assert mounts["nvme"]["subPathExpr"] == "$(POD_NAME)"  # two nodes on one machine keep apart


def test_the_nodes_host_pool_fits_its_shm_and_its_memory_limit(trying_it_out):
    pod = trying_it_out["StatefulSet", "strata-node"]["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    host = strata_size(env_of(node)["STRATA_HOST_BYTES"]["value"])
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in node["volumeMounts"]
    shm_bytes = kubernetes_quantity(shm["emptyDir"]["sizeLimit"])
    assert shm_bytes_needed(host) <= shm_bytes
    # An in-memory emptyDir is charged to the pod: the limit holds it and the processes beside it.
    assert kubernetes_quantity(node["resources"]["limits"]["memory"]) > shm_bytes


def test_the_chart_refuses_a_shm_too_small_for_the_host_pool():
    with pytest.raises(helm_python.HelmRenderError, match="nodes.shmHeadroomGiB"):
        render({"nodes": {"hostPoolGiB": 200, "shmHeadroomGiB": 4}})
    objects = by_kind_and_name(render({"nodes": {"hostPoolGiB": 200, "shmHeadroomGiB": 5}}))
    pod = objects["StatefulSet", "strata-node"]["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm_bytes_needed(200 * 1024**3) <= kubernetes_quantity(shm["emptyDir"]["sizeLimit"])


def test_each_node_reads_the_credential_the_job_issues_for_it(trying_it_out):
    values = {"nodes": {"replicas": 3}}
    objects = by_kind_and_name(render(values))
    statefulset = objects["StatefulSet", "strata-node"]
    pods = [f"strata-node-{i}" for i in range(statefulset["spec"]["replicas"])]
    job = objects["Job", "strata-node-credentials"]
    (issue,) = job["spec"]["template"]["spec"]["initContainers"]
    job_env = env_of(issue)
    assert job_env["NODES"]["value"].split() == pods == ["strata-node-0", "strata-node-1", "strata-node-2"]
    secret = job_env["SECRET_NAME"]["value"]
    pod = statefulset["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    mount = next(m for m in node["volumeMounts"] if m["name"] == "credentials")
    volume = next(v for v in pod["volumes"] if v["name"] == "credentials")
    assert volume["secret"]["secretName"] == secret and mount["readOnly"] is True
    assert env_of(node)["DATABASE_URL_FILE"]["value"] == f"{mount['mountPath']}/$(POD_NAME).url"
    assert env_of(node)["REDIS_URL_FILE"]["value"] == f"{mount['mountPath']}/$(POD_NAME).redis.url"
    assert "REDIS_URL" not in env_of(node)  # the node's own user, not the control plane's
    # Its own admin key from the same Secret; the fleet-wide one is the control plane's alone.
    assert env_of(node)["STRATA_NODE_ADMIN_KEY_FILE"]["value"] == f"{mount['mountPath']}/$(POD_NAME).admin.key"
    assert "STRATA_NODE_ADMIN_KEY" not in env_of(node)
    web = objects["Deployment", "strata-web"]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(web)["STRATA_NODE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "node-admin-key"
    # The Job keeps the keys already issued: it reads the Secret it writes.
    existing = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "existing")
    assert existing["secret"] == {"secretName": secret, "optional": True}
    (apply,) = job["spec"]["template"]["spec"]["containers"]
    assert apply["command"] == ["kubectl", "apply", "-f", f"{job_env['WORK_DIR']['value']}/secret.json"]


def test_the_credentials_job_may_write_only_its_secret(trying_it_out):
    role = trying_it_out["Role", "strata-node-credentials"]
    binding = trying_it_out["RoleBinding", "strata-node-credentials"]
    job = trying_it_out["Job", "strata-node-credentials"]["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": job["serviceAccountName"], "namespace": "serving"}
    ]
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""] and rule["resources"] == ["secrets"]
        # Creating cannot be limited by name in Kubernetes; everything else is.
        assert rule.get("resourceNames") == ["strata-node-credentials"] or rule["verbs"] == ["create"]
    # Only the Job's pod holds a token; the control plane's pods have none.
    for component in CONTROL_PLANE:
        pod = trying_it_out["Deployment", f"strata-{component}"]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False


def _run_issue_script(trying_it_out, tmp_path, existing: dict[str, str]) -> tuple[dict, list[str]]:
    """Run the credentials Job's script as the chart ships it, with `strata credential` replaced
    by a stand-in that records its arguments and writes the files the real one writes."""
    script = trying_it_out["ConfigMap", "strata-node-credentials"]["data"]["issue.sh"]
    (issue,) = trying_it_out["Job", "strata-node-credentials"]["spec"]["template"]["spec"]["initContainers"]
    bin_dir, existing_dir, work_dir = tmp_path / "bin", tmp_path / "existing", tmp_path / "work"
    for folder in (bin_dir, existing_dir, work_dir):
        folder.mkdir()
    for name, url in existing.items():
        (existing_dir / name).write_text(url)
    calls = tmp_path / "calls"
    (bin_dir / "strata").write_text(
        f"#!{sys.executable}\n"
        "import sys, pathlib\n"
        f"pathlib.Path({str(calls)!r}).open('a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1] == 'credential':\n"
        "    nodes, folder = sys.argv[2:sys.argv.index('--url-dir')], sys.argv[sys.argv.index('--url-dir') + 1]\n"
        "    keys_only = '--admin-key' in nodes\n"
        "    for node in [n for n in nodes if n != '--admin-key']:\n"
        "        pathlib.Path(folder, node + '.admin.key').write_text(f'key-of-{node}\\n')\n"
        "        if not keys_only:\n"
        "            pathlib.Path(folder, node + '.url').write_text(f'postgresql://strata_node_{node}:new@db/strata\\n')\n"
        "            pathlib.Path(folder, node + '.redis.url').write_text(f'redis://strata_node_{node}:new@redis/0\\n')\n"
    )
    (bin_dir / "strata").chmod(stat.S_IRWXU)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "NODES": env_of(issue)["NODES"]["value"],
        "SECRET_NAME": env_of(issue)["SECRET_NAME"]["value"],
        "SECRET_NAMESPACE": "serving",
        "EXISTING_DIR": str(existing_dir),
        "WORK_DIR": str(work_dir),
    }
    result = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines() if calls.exists() else []
    return json.loads((work_dir / "secret.json").read_text()), lines


def test_the_credentials_script_issues_only_missing_nodes_and_keeps_the_rest(tmp_path):
    objects = by_kind_and_name(render({"nodes": {"replicas": 2}}))
    kept = "postgresql://strata_node_strata-node-0:old@db/strata\n"
    kept_redis = "redis://strata_node_strata-node-0:old@redis/0\n"
    secret, calls = _run_issue_script(
        objects, tmp_path, {"strata-node-0.url": kept, "strata-node-0.redis.url": kept_redis}
    )
    urls_dir = str(tmp_path / "work" / "urls")
    assert calls == [
        GRANTS,
        "credential strata-node-1 --url-dir " + urls_dir,
        # strata-node-0 was issued before nodes had their own admin keys: its key, its password unchanged.
        "credential strata-node-0 --admin-key --url-dir " + urls_dir,
    ]
    kubernetes_validate.validate(secret, kubernetes_validate.latest_version(), strict=True)
    assert secret["metadata"] == {
        "name": "strata-node-credentials",
        "namespace": "serving",
        "labels": {"app.kubernetes.io/component": "node-credentials"},
    }
    urls = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert urls == {
        "strata-node-0.url": kept,
        "strata-node-0.redis.url": kept_redis,
        "strata-node-0.admin.key": "key-of-strata-node-0\n",
        "strata-node-1.url": "postgresql://strata_node_strata-node-1:new@db/strata\n",
        "strata-node-1.redis.url": "redis://strata_node_strata-node-1:new@redis/0\n",
        "strata-node-1.admin.key": "key-of-strata-node-1\n",
    }


def test_a_node_issued_before_redis_users_gets_both_urls_anew(tmp_path):
    objects = by_kind_and_name(render({"nodes": {"replicas": 1}}))
    secret, calls = _run_issue_script(objects, tmp_path, {"strata-node-0.url": "postgresql://old@db/strata\n"})
    assert calls[1] == "credential strata-node-0 --url-dir " + str(tmp_path / "work" / "urls")
    assert sorted(secret["data"]) == ["strata-node-0.admin.key", "strata-node-0.redis.url", "strata-node-0.url"]


def test_the_credentials_script_issues_nothing_when_every_node_has_one(tmp_path):
    objects = by_kind_and_name(render({"nodes": {"replicas": 1}}))
    existing = {
        "strata-node-0.url": "postgresql://kept@db/strata\n",
        "strata-node-0.redis.url": "redis://kept@redis/0\n",
        "strata-node-0.admin.key": "kept-key\n",
    }
    secret, calls = _run_issue_script(objects, tmp_path, existing)
    assert calls == [GRANTS]  # tables added by an upgrade's migrations reach the nodes' group all the same
    assert base64.b64decode(secret["data"]["strata-node-0.url"]) == b"postgresql://kept@db/strata\n"
    assert base64.b64decode(secret["data"]["strata-node-0.admin.key"]) == b"kept-key\n"


def test_the_grants_step_calls_the_credentials_service():
    code = GRANTS.split(" -c ", 1)[1]
    module, name = re.fullmatch(r"from (\S+) import (\w+); (\w+)\(\)", code).groups()[:2]
    assert callable(getattr(importlib.import_module(module), name))


def test_the_prometheus_operator_objects_match_the_chart_and_the_alerts(trying_it_out):
    alerts = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    rule = trying_it_out["PrometheusRule", "strata"]
    assert rule["spec"]["groups"] == alerts["groups"]
    jobs = {}
    for name, component in (("strata-controlplane", "web"), ("strata-nodes", "node")):
        monitor = trying_it_out["ServiceMonitor", name]
        service = next(
            o
            for (kind, _), o in trying_it_out.items()
            if kind == "Service" and o["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        service_ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"
            (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
            jobs.setdefault(name, set()).add(job)
    # The jobs the dashboard and the alerts select on.
    assert jobs == {"strata-controlplane": {"strata-controlplane"}, "strata-nodes": {"strata-nodes"}}
    dashboard = trying_it_out["ConfigMap", "strata-grafana-dashboard"]
    assert json.loads(dashboard["data"]["strata.json"]) == json.loads(
        (REPO_ROOT / "deploy" / "grafana" / "strata.json").read_text()
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_operator_objects_are_off_unless_asked_for():
    kinds = {obj["kind"] for obj in render()}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}


def test_trying_it_out_runs_postgresql_and_redis_in_the_cluster(trying_it_out):
    postgres = trying_it_out["StatefulSet", "strata-postgresql"]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(postgres)["POSTGRES_INITDB_ARGS"]["value"] == "--data-checksums"
    redis = trying_it_out["StatefulSet", "strata-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["command"][:3] == ["redis-server", "--appendonly", "yes"]
    database = trying_it_out["Secret", "strata-postgresql"]["data"]
    url = base64.b64decode(database["database-url"]).decode()
    password = base64.b64decode(database["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    assert url == f"postgresql://strata:{password}@strata-postgresql:5432/strata"
    redis_url = base64.b64decode(trying_it_out["Secret", "strata-redis"]["data"]["redis-url"]).decode()
    assert redis_url.startswith("redis://:") and redis_url.endswith("@strata-redis:6379/0")
    keys = trying_it_out["Secret", "strata-app"]["data"]
    assert len(base64.b64decode(keys["secret-key"])) >= 50 and len(base64.b64decode(keys["node-admin-key"])) >= 32


def test_a_fleet_reads_its_database_and_redis_urls_from_its_own_secrets(fleet):
    kinds = {kind for kind, _ in fleet}
    assert "Secret" not in kinds  # every secret is the operator's
    assert ("StatefulSet", "strata-postgresql") not in fleet and ("StatefulSet", "strata-redis") not in fleet
    for component in CONTROL_PLANE:
        (container,) = fleet["Deployment", f"strata-{component}"]["spec"]["template"]["spec"]["containers"]
        env = env_of(container)
        assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "strata-database", "key": "database-url"}
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "strata-redis-url", "key": "redis-url"}
        assert env["STRATA_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "strata-keys"
        assert "strata.example.com" in env["STRATA_ALLOWED_HOSTS"]["value"].split(",")
    (node,) = fleet["StatefulSet", "strata-node"]["spec"]["template"]["spec"]["containers"]
    env = env_of(node)
    assert "REDIS_URL" not in env and env["REDIS_URL_FILE"]["value"].endswith(".redis.url")  # its own user
    assert env["PGSSLMODE"]["value"] == "verify-full"  # libpq's, for the node's own credential
    assert fleet["StatefulSet", "strata-node"]["spec"]["replicas"] == 4


def test_a_fleet_without_its_database_secret_is_refused():
    with pytest.raises(helm_python.HelmRenderError, match="externalDatabase.existingSecret"):
        render({"postgresql": {"enabled": False}})


def test_the_chart_files_are_the_deploy_files():
    """files/ links to the rules and the dashboard compose uses: one copy of each."""
    for name, target in (("alerts.yml", "prometheus/alerts.yml"), ("strata.json", "grafana/strata.json")):
        link = CHART / "files" / name
        assert link.is_symlink() and link.resolve() == (REPO_ROOT / "deploy" / target).resolve()
    assert os.access(CHART / "files" / "issue-node-credentials.sh", os.R_OK)
