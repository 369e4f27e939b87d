"""The `strata` command: every Strata process and administrative step, installed with the package.

    strata migrate                      create or upgrade the control plane's tables
    strata web [--host H] [--port P]    the control plane: dashboard, REST API, websockets (ASGI)
    strata api [--bind H:P]             the engines' REST API on a WSGI server (lookups, registrations)
    strata control-worker               the Celery worker of the control queue (movements, policies)
    strata beat                         the Celery scheduler (heartbeat checks, planned movements)
    strata node --name N ...            a node: its worker, its tiers, its engine (`--engine vllm`)
    strata credential N [N ...]         nodes' own database and Redis credentials
    strata manage COMMAND ...           any other administrative command of the control plane
    strata version                      the installed version

The servers replace this process (signals reach them directly, as a container's init expects).
Settings come from DJANGO_SETTINGS_MODULE (default `controlplane.settings.dev`; deployments set
`controlplane.settings.prod`), DATABASE_URL, REDIS_URL and the STRATA_* variables, as for every
Strata process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from controlplane import __version__

DEFAULT_SETTINGS = "controlplane.settings.dev"

COMMANDS: dict[str, str] = {
    "migrate": "create or upgrade the control plane's tables",
    "web": "serve the control plane: dashboard, REST API and websockets (ASGI, daphne)",
    "api": "serve the engines' REST API on a WSGI server (gunicorn): lookups and registrations",
    "control-worker": "run the Celery worker of the control queue (movements, policies, maintenance)",
    "beat": "run the Celery scheduler (heartbeat checks, planned movements)",
    "node": "run a node: its Celery worker, tiers, heartbeat and engine (options of `strata node --help`)",
    "credential": "create nodes' own database and Redis credentials (options of `strata credential --help`)",
    "manage": "run any administrative command of the control plane (`strata manage help` lists them)",
    "version": "print the installed version",
}
"""The sub-commands, each with its one-line help (deployment files are checked against these)."""

DJANGO_COMMANDS = {"node": "strata_node", "credential": "strata_node_credential"}
"""Sub-commands that are the control plane's administrative commands under a shorter name."""


def _settings() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", DEFAULT_SETTINGS)


def _exec(argv: list[str]) -> None:
    """Replace this process with `python -m ...` (the same interpreter, so the same environment)."""
    _settings()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])


def _django(usage: tuple[str, str], name: str, argv: Sequence[str]) -> int:
    """Run the administrative command `name`; its usage and help read `usage[0] usage[1] ...`."""
    _settings()
    import django
    from django.core.management import get_commands, load_command_class

    django.setup()
    commands = get_commands()
    if name not in commands:
        raise SystemExit(f"strata: no administrative command {name!r} (`strata manage help` lists them)")
    load_command_class(commands[name], name).run_from_argv([*usage, *argv])
    return 0


def _proxy() -> list[str]:
    """Behind a proxy the operator declared (STRATA_PROXY_SSL_HEADER), daphne takes the client's
    address from X-Forwarded-For (the login throttle counts by it); otherwise it trusts no header."""
    return ["--proxy-headers"] if os.environ.get("STRATA_PROXY_SSL_HEADER", "").strip() else []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata",
        description="Strata: tiered KV-cache offloading for LLM inference, and its control plane.",
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        kwargs: dict[str, object] = {"help": text, "description": text}
        if name in DJANGO_COMMANDS or name == "manage":
            kwargs["add_help"] = False  # --help is the command's own
        command = sub.add_parser(name, **kwargs)  # type: ignore[arg-type]
        if name == "web":
            command.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
            command.add_argument("--port", type=int, default=8000, help="port (default 8000)")
        elif name == "api":
            command.add_argument("--bind", default="0.0.0.0:8001", help="HOST:PORT to listen on (default 0.0.0.0:8001)")
        elif name == "control-worker":
            command.add_argument("--concurrency", type=int, default=4, help="threads (default 4)")
        elif name == "migrate":
            command.add_argument("--plan", action="store_true", help="show the migrations that would run, run none")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] in DJANGO_COMMANDS:  # every option, --help included, is the command's own
        return _django(("strata", argv[0]), DJANGO_COMMANDS[argv[0]], argv[1:])
    if argv and argv[0] == "manage":
        if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
            _settings()
            from django.core.management import execute_from_command_line

            execute_from_command_line(["strata manage", "help", *argv[2:]])
            return 0
        return _django(("strata manage", argv[1]), argv[1], argv[2:])
    args = parser.parse_args(argv)
    runners: dict[str, Callable[[], int | None]] = {
        "migrate": lambda: _django(("strata", "migrate"), "migrate", ["--noinput", *(["--plan"] if args.plan else [])]),
        "web": lambda: _exec(
            ["-m", "daphne", "-b", args.host, "-p", str(args.port), *_proxy(), "controlplane.asgi:application"]
        ),
        "api": lambda: _exec(
            [
                "-m",
                "gunicorn",
                "-c",
                "python:controlplane.runtime.gunicorn",
                "-b",
                args.bind,
                "controlplane.wsgi:application",
            ]
        ),
        "control-worker": lambda: _exec(
            ["-m", "celery", "-A", "controlplane.celery_app", "worker", "-Q", "control", "--pool", "threads"]
            + ["--concurrency", str(args.concurrency)]
        ),
        "beat": lambda: _exec(["-m", "celery", "-A", "controlplane.celery_app", "beat", "--pidfile="]),
        "version": lambda: print(__version__),
    }
    return runners[args.command]() or 0


if __name__ == "__main__":
    sys.exit(main())
