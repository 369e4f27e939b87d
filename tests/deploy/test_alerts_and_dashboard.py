"""The alert rules and the Grafana dashboard: they parse, page on what they say, refer only to
metrics Strata exports, and the dashboard's panels follow its variables."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.metric_names import REPO_ROOT, exported_series, metric_names

ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.test.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "strata.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: `apt-get install prometheus` (make setup does it as root)"
)
# Grafana's own variables, set at query time.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}


@pytest.fixture(scope="module")
def rules():
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def _dashboard_exprs(dashboard) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [annotation["expr"] for annotation in dashboard["annotations"]["list"] if "expr" in annotation]
    return exprs


def test_every_alert_pages_on_metrics_strata_exports(rules):
    exported = exported_series()
    assert {"StrataCorruptBlocks", "StrataLookupFailures", "StrataTierFull", "StrataNodeStale"} <= {
        rule["alert"] for rule in rules
    }
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= exported, f"{rule['alert']} refers to {sorted(names - exported)}, which no code defines"
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_is_exercised_by_the_rule_tests(rules):
    tested = {
        case["alertname"]
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert tested == {rule["alert"] for rule in rules}


@needs_promtool
def test_the_rules_parse_and_fire_as_their_tests_say():
    check = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=120)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout


def test_the_dashboard_refers_only_to_metrics_strata_exports(dashboard):
    exported = exported_series()
    for expr in _dashboard_exprs(dashboard):
        names = metric_names(expr)
        assert names and names <= exported, f"{expr!r} refers to {sorted(names - exported)}"


def test_the_dashboards_variables_are_defined_and_used(dashboard):
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "node", "model"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # The node list follows the chosen model, so a model narrows every panel that filters on node.
    assert "$model" in variables["node"]["query"]["query"]
    text = json.dumps(dashboard["panels"]) + json.dumps(dashboard["annotations"])
    used = set(re.findall(r"\$\{?(\w+)\}?", text))
    assert used - GRAFANA_VARIABLES == set(variables), used
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for name in metric_names(target["expr"]):
                # Every series that carries a node label is filtered by the node variable.
                if name.startswith(("strata_hit", "strata_lookup", "strata_load", "strata_layer", "strata_ttft")):
                    assert 'node=~"$node"' in target["expr"], (panel["title"], target["expr"])
    model_panels = [p["title"] for p in dashboard["panels"] if "$model" in json.dumps(p.get("targets", []))]
    assert len(model_panels) >= 3, model_panels


@needs_promtool
def test_the_dashboards_queries_parse(tmp_path, dashboard):
    """promtool parses each query (with Grafana's variables given values) as a recording rule."""
    substitutions = {"$__rate_interval": "5m", "$node": ".*", "$model": ".*"}
    records = []
    for n, expr in enumerate(_dashboard_exprs(dashboard)):
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        records.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(records)} rules found" in check.stdout
