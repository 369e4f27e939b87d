"""Reading DATABASE_URL / REDIS_URL: embedded defaults, external servers, and refusals that name the variable."""

import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.runtime.environment import ConfigurationError, load_environment

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_unset_urls_mean_embedded_services(tmp_path):
    env = load_environment({"STRATA_VAR_DIR": str(tmp_path)})
    assert env.embedded_postgres and env.embedded_redis
    assert env.database.host == str(tmp_path / "run")
    assert env.redis.scheme == "unix" and env.redis.socket_path == str(tmp_path / "run" / "redis.sock")
    assert env.redis.celery_url(0).startswith("redis+socket://")


def test_long_var_dir_moves_sockets_to_tmp(tmp_path):
    deep = tmp_path / ("x" * 120)
    env = load_environment({"STRATA_VAR_DIR": str(deep)})
    assert env.database.host.startswith("/tmp/strata-")
    assert len(env.redis.socket_path) < 100


def test_external_urls():
    env = load_environment(
        {
            "DATABASE_URL": "postgresql://u:p%40ss@db.example:6543/strata?sslmode=require",
            "REDIS_URL": "redis://cache:6380/4",
        }
    )
    assert (env.database.user, env.database.password, env.database.host, env.database.port) == (
        "u",
        "p@ss",
        "db.example",
        "6543",
    )
    assert env.database.options == {"sslmode": "require"}
    assert env.redis.url_for_db(5) == "redis://cache:6380/5"
    assert not env.embedded_postgres and not env.embedded_redis


def test_database_url_from_a_file(tmp_path):
    url_file = tmp_path / "gpu-0.url"
    url_file.write_text("postgresql://strata_node_gpu_0:s3cret@db.example:5432/strata\n")
    env = load_environment({"DATABASE_URL_FILE": str(url_file), "REDIS_URL": "redis://cache:6379/0"})
    assert (env.database.user, env.database.password, env.database.name) == ("strata_node_gpu_0", "s3cret", "strata")
    assert not env.embedded_postgres
    with pytest.raises(ConfigurationError, match="DATABASE_URL_FILE: set beside DATABASE_URL"):
        load_environment({"DATABASE_URL_FILE": str(url_file), "DATABASE_URL": "postgresql://h/db"})
    with pytest.raises(ConfigurationError, match="DATABASE_URL_FILE: cannot read .*missing.url: No such file"):
        load_environment({"DATABASE_URL_FILE": str(tmp_path / "missing.url")})
    (tmp_path / "empty.url").write_text("\n")
    with pytest.raises(ConfigurationError, match="DATABASE_URL_FILE: .*empty.url is empty"):
        load_environment({"DATABASE_URL_FILE": str(tmp_path / "empty.url")})


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("REDIS_URL", "nonsense", "REDIS_URL: expected a redis://"),
        ("REDIS_URL", "redis://host/notanumber", "REDIS_URL: the database number"),
        ("REDIS_URL", "redis://host:99999/0", "REDIS_URL: not a valid URL"),
        ("DATABASE_URL", "sqlite:///db.sqlite3", "DATABASE_URL: expected a postgres://"),
        ("DATABASE_URL", "postgresql://host:5432/", "DATABASE_URL: the URL names no database"),
        ("DATABASE_URL", "", "DATABASE_URL: set but empty"),
    ],
)
def test_bad_values_are_refused_naming_the_variable(variable, value, expected):
    with pytest.raises(ConfigurationError, match=expected):
        load_environment({variable: value})


@pytest.mark.parametrize("variable", ["REDIS_URL", "DATABASE_URL"])
def test_bad_url_stops_startup_with_one_line(variable, tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", variable: "nonsense", "STRATA_VAR_DIR": str(tmp_path)},
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"strata: {variable}: ")
