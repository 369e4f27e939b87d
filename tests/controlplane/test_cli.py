"""The `strata` command: each sub-command's help, the administrative commands under their short
names, and bad input refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from controlplane import __version__
from controlplane.cli import COMMANDS, DJANGO_COMMANDS, main


def strata(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_help_lists_every_command_and_version_prints_the_package_s():
    listing = strata("--help")
    assert listing.returncode == 0
    assert all(name in listing.stdout for name in COMMANDS)
    assert strata("version").stdout.strip() == __version__
    assert strata("--version").stdout.strip() == f"strata {__version__}"


@pytest.mark.parametrize("name", sorted(DJANGO_COMMANDS))
def test_the_administrative_commands_answer_help_under_their_short_names(name):
    answer = strata(name, "--help")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith(f"usage: strata {name} ")


@pytest.mark.parametrize("name", ["web", "api", "control-worker", "beat", "migrate"])
def test_each_server_command_has_its_own_help(name):
    answer = strata(name, "--help")
    assert answer.returncode == 0 and f"usage: strata {name}" in answer.stdout, answer.stderr


def test_an_unknown_command_or_administrative_command_is_refused_by_name():
    answer = strata("serve-everything")
    assert answer.returncode == 2 and "invalid choice: 'serve-everything'" in answer.stderr
    with pytest.raises(SystemExit, match="no administrative command 'nosuch'"):
        main(["manage", "nosuch"])


def test_migrate_plan_runs_against_the_configured_database(subprocess_env):
    answer = strata("migrate", "--plan", env=subprocess_env)
    assert answer.returncode == 0, answer.stderr
    assert "Planned operations" in answer.stdout
