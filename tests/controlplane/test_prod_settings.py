"""Production settings: the database connection pool and its option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = "s" * 60


def prod_probe(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh process under the production settings (a secret, a database URL,
    state under `tmp_path`, then `env`)."""
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.prod",
            "STRATA_SECRET_KEY": SECRET,
            "STRATA_VAR_DIR": str(tmp_path),
            "DATABASE_URL": "postgresql://strata@127.0.0.1:5432/strata",
            **env,
        },
    )


def _settings(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "from django.conf import settings; import json; "
        "print(json.dumps({'pool': settings.DATABASES['default']['OPTIONS'].get('pool'), "
        "'age': settings.DATABASES['default']['CONN_MAX_AGE']}))"
    )
    return prod_probe(tmp_path, code, **env)


def test_production_pools_database_connections(tmp_path):
    result = _settings(tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"pool": {"min_size": 2, "max_size": 8, "timeout": 10}' in result.stdout
    assert '"age": 0' in result.stdout  # Django refuses persistent connections beside a pool


def test_the_pool_can_be_turned_off(tmp_path):
    result = _settings(tmp_path, STRATA_DB_POOL_MAX="0")
    assert result.returncode == 0, result.stderr
    assert '"pool": null' in result.stdout


def test_a_bad_pool_size_stops_start_up_naming_the_variable(tmp_path):
    result = _settings(tmp_path, STRATA_DB_POOL_MAX="lots")
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "strata: STRATA_DB_POOL_MAX: expected a whole number of connections (0 = no pool), got 'lots'"
    )
