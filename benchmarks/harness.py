"""The benchmark harness: discovers suites, shows progress, prints one table, writes JSON results.

    python -m benchmarks                 # every suite
    python -m benchmarks tiers           # some suites
    python -m benchmarks tiers --scale 0.1 --repeats 3
    STRATA_BENCH_SCALE=0.05 python -m benchmarks tiers
    python -m benchmarks --smoke         # every suite at the least size, once (make bench-smoke)

Each suite writes ``benchmarks/results/<suite>.json``: its rows (name, value, unit, and for a
ratio the name of the baseline row it divides by), parameters and a description of the machine.

A suite declares the rows every run of it must produce, as shell-style patterns (`EXPECTED_ROWS`,
or `expected_rows(ctx)` where they depend on the run's options), one or more per configuration
it measures. A run fails (exit 1) when a suite raises, yields no rows, reports configurations that
failed (`failed` in its params) or leaves a pattern unmatched: a suite whose configuration stopped
working is a failure, not a shorter table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import importlib
import json
import os
import pkgutil
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SUITES_PACKAGE = "benchmarks.suites"
SMOKE_SCALE = 0.01
"""`--smoke`: the scale every suite runs at (each suite keeps its own least sizes)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured number."""

    name: str
    value: float
    unit: str
    baseline: str | None = None
    """For a ratio: the name of the row it divides by (its numerator is the row named like it)."""
    note: str = ""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
        }
        if self.note:
            data["note"] = self.note
        if self.params:
            data["params"] = self.params
        return data


@dataclasses.dataclass
class Context:
    """What a suite gets: the size to run at, where to put scratch files, a progress hook."""

    scale: float
    """Fraction of the suite's full size (1.0 = as specified; smaller for a quick run)."""
    repeats: int
    scratch: Path
    """A fresh directory for the suite's files, removed afterwards (on the filesystem under test)."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Parameters the suite reports with its results."""
    _plan: Callable[[int], None] = lambda total: None
    _advance: Callable[[str], None] = lambda label: None
    _log: Callable[[str], None] = lambda message: None

    def plan(self, steps: int) -> None:
        """Announce how many steps the suite will take (drives the progress bar)."""
        self._plan(steps)

    def step(self, label: str) -> None:
        """One step done."""
        self._advance(label)

    def log(self, message: str) -> None:
        self._log(message)


def run_child(
    ctx: Context, module: str, spec: dict[str, Any], env: dict[str, str], notes: dict[str, str] | None = None
) -> list[Row]:
    """Run `python -m module <spec as JSON>` (a suite that needs its own process, e.g. Django
    configured for a scratch database) and turn the JSON lines it prints into progress and rows:
    {"plan": n}, {"step": label}, {"log": text}, {"param": {...}}, {"row": {...}}; other lines are logged."""
    import subprocess

    rows: list[Row] = []
    child = subprocess.Popen(
        [sys.executable, "-m", module, json.dumps(spec)],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    for line in child.stdout:
        if not line.startswith("{"):
            ctx.log(line.rstrip())
            continue
        message = json.loads(line)
        if "plan" in message:
            ctx.plan(message["plan"])
        elif "step" in message:
            ctx.step(message["step"])
        elif "log" in message:
            ctx.log(message["log"])
        elif "param" in message:
            ctx.params.update(message["param"])
        elif "row" in message:
            row = dict(message["row"])
            row.setdefault("note", (notes or {}).get(row["name"], ""))
            rows.append(Row(**row))
    if child.wait() != 0:
        raise RuntimeError(f"the benchmark process {module} failed (exit {child.returncode})")
    return rows


def discover() -> list[str]:
    """Names of the suite modules in benchmarks/suites/, without importing them (a suite with
    heavy or broken imports must not stop the others)."""
    package = importlib.import_module(SUITES_PACKAGE)
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))


def load(name: str) -> ModuleType:
    module = importlib.import_module(f"{SUITES_PACKAGE}.{name}")
    if not callable(getattr(module, "run", None)):
        raise TypeError(f"suite {name} has no run(ctx) function")
    if not callable(getattr(module, "expected_rows", None)) and not getattr(module, "EXPECTED_ROWS", None):
        raise TypeError(f"suite {name} declares no EXPECTED_ROWS (the rows every run of it must produce)")
    return module


def expected_rows(module: ModuleType, ctx: Context) -> list[str]:
    """The row-name patterns a run of the suite must match, each at least once."""
    declared = module.expected_rows(ctx) if callable(getattr(module, "expected_rows", None)) else module.EXPECTED_ROWS
    return list(declared)


def missing(module: ModuleType, ctx: Context, rows: Sequence[Row]) -> list[str]:
    """What the run lacks: no rows at all, configurations the suite reports failed, and every
    expected pattern no row matches (empty when the run is whole)."""
    if not rows:
        return ["it produced no rows"]
    problems = []
    failed = ctx.params.get("failed") or {}
    problems += [f"configuration {config} failed: {why}" for config, why in sorted(dict(failed).items())]
    names = [row.name for row in rows]
    problems += [
        f"no row matches {pattern}"
        for pattern in expected_rows(module, ctx)
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names)
    ]
    return problems


def _machine() -> dict[str, Any]:
    import torch  # noqa: PLC0415 - only for the report

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        info["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return info


def _format(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3f}"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    suites = discover()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", help=f"suites to run (default: all of {', '.join(suites)})")
    parser.add_argument(
        "--scale",
        type=float,
        default=float(os.environ.get("STRATA_BENCH_SCALE", "1.0")),
        help="fraction of the full size (env STRATA_BENCH_SCALE; default 1.0)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=int(os.environ.get("STRATA_BENCH_REPEATS", "3")),
        help="interleaved repetitions per measurement; the median is reported (default 3)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="directory on the filesystem to benchmark (default: the system temp dir)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where <suite>.json files go")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"every suite at scale {SMOKE_SCALE:g}, once: does each still produce all its rows (a few minutes)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.scale, args.repeats = SMOKE_SCALE, 1
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # log files: do not truncate row names
    if args.list:
        for name in suites:
            try:
                description = getattr(load(name), "DESCRIPTION", "")
            except Exception as exc:  # listing must show every suite, importable or not
                description = f"(cannot be loaded: {exc})"
            console.print(f"{name}: {description}")
        return 0
    unknown = [name for name in args.suites if name not in suites]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(suites)}")
    if not 0 < args.scale <= 1000 or args.repeats < 1:
        parser.error("--scale must be positive and --repeats at least 1")
    selected = args.suites or list(suites)
    args.results.mkdir(parents=True, exist_ok=True)

    table = Table(title=f"Strata benchmarks (scale {args.scale:g}, {args.repeats} repeats, median)")
    for column, justify in (
        ("suite", "left"),
        ("name", "left"),
        ("value", "right"),
        ("unit", "left"),
        ("baseline (for ratios)", "left"),
    ):
        table.add_column(column, justify=justify)
    failures = 0
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[suite]}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    )
    with progress:
        for name in selected:
            try:
                module = load(name)
            except Exception as exc:
                failures += 1
                progress.console.print(f"[red]suite {name} cannot be loaded: {exc}")
                continue
            task = progress.add_task("starting", total=None, suite=name)
            if args.scratch:
                Path(args.scratch).mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f"strata-bench-{name}-", dir=args.scratch))
            context = Context(
                scale=args.scale,
                repeats=args.repeats,
                scratch=scratch,
                _plan=lambda total, task=task: progress.update(task, total=total),
                _advance=lambda label, task=task: progress.update(task, advance=1, description=label),
                _log=lambda message: progress.console.print(message),
            )
            started = time.time()
            load_at_start = os.getloadavg()
            if load_at_start[0] > (os.cpu_count() or 1) * 0.5:
                progress.console.print(
                    f"[yellow]load average {load_at_start[0]:.2f} at the start of {name}: "
                    "other processes share the CPUs, expect noisy numbers"
                )
            try:
                rows = module.run(context)
            except Exception as exc:  # one failing suite must not hide the others' results
                failures += 1
                progress.console.print_exception()
                progress.console.print(f"[red]suite {name} failed: {exc}")
                continue
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            lacking = missing(module, context, rows)
            if lacking:
                failures += 1
                progress.console.print(f"[red]suite {name} is incomplete: {'; '.join(lacking)}")
            progress.update(task, description="done" if not lacking else "incomplete")
            result = {
                "suite": name,
                "description": getattr(module, "DESCRIPTION", ""),
                "started_at": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(),
                "duration_s": round(time.time() - started, 2),
                "params": {"scale": args.scale, "repeats": args.repeats, **context.params},
                "machine": {**_machine(), "loadavg_at_start": load_at_start},
                "rows": [row.as_json() for row in rows],
                "incomplete": lacking,
            }
            (args.results / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            for row in rows:
                table.add_row(name, row.name, _format(row.value, row.unit), row.unit, row.baseline or "")
    console.print(table)
    console.print(f"results in {args.results}/")
    if failures:
        console.print(f"[red]{failures} suite(s) failed or incomplete (see above)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
