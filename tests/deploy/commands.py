"""Checks that a deployment file's command is a `strata` command that exists, with options its
command accepts, and that the server it starts is this project's."""

from __future__ import annotations

import importlib.util
from unittest import mock

from tests.deploy.metric_names import REPO_ROOT


class _Exec(Exception):
    """Raised in place of os.execv: carries the command line `strata` would have become."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.argv = argv


def _exec(path: str, argv: list[str]) -> None:
    raise _Exec(argv)


def _check_module_command(argv: list[str]) -> None:
    """`PYTHON -m daphne|gunicorn|celery ...` as `strata` starts it: the module is installed and
    the application, configuration and Celery app it names are this project's."""
    assert argv[1] == "-m", argv
    module = argv[2]
    assert importlib.util.find_spec(module) is not None, f"module {module} not installed"
    if module in ("daphne", "gunicorn"):
        app_module, _, attribute = argv[-1].partition(":")
        assert (REPO_ROOT / (app_module.replace(".", "/") + ".py")).exists(), argv
        assert attribute == "application", argv
    if module == "gunicorn":
        config = argv[argv.index("-c") + 1]
        assert config.startswith("python:") and importlib.util.find_spec(config.removeprefix("python:")), config
    if module == "celery":
        app_module = argv[argv.index("-A") + 1]
        assert (REPO_ROOT / (app_module.replace(".", "/") + ".py")).exists(), argv
        assert argv[argv.index("-A") + 2] in {"worker", "beat"}, argv


def check_strata_command(argv: list[str]) -> list[str] | None:
    """Assert that `argv` is a valid `strata` command line; returns the server command line it
    execs into (None for the commands that run in the process: migrate, node, credential)."""
    from django.core.management import get_commands, load_command_class

    from controlplane import cli

    assert argv[0] == "strata", argv
    assert argv[1] in cli.COMMANDS, f"`strata {argv[1]}` is not a command ({sorted(cli.COMMANDS)})"
    if argv[1] in cli.DJANGO_COMMANDS:
        name = cli.DJANGO_COMMANDS[argv[1]]
        command = load_command_class(get_commands()[name], name)
        command.create_parser("strata", argv[1]).parse_args(argv[2:])  # CommandError on an unknown option
        return None
    if argv[1] == "migrate":
        assert set(argv[2:]) <= {"--plan"}, argv
        return None
    with mock.patch.object(cli.os, "execv", _exec):
        try:
            cli.main(argv[1:])
        except _Exec as started:
            _check_module_command(started.argv)
            return started.argv[1:]
    raise AssertionError(f"{argv} starts no server")
