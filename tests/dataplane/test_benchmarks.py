"""The benchmark harness runs the `tiers` suite end to end (tiny size) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_list_shows_the_tiers_suite() -> None:
    listed = _run("--list")
    assert listed.returncode == 0, listed.stderr
    assert "tiers:" in listed.stdout


def test_tiers_suite_writes_rows_with_baselines(tmp_path) -> None:
    done = _run(
        "tiers",
        "--scale",
        "0.001",
        "--repeats",
        "1",
        "--results",
        str(tmp_path),
        "--scratch",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "tiers.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}
    for tier in ("device", "host", "disk", "remote"):
        for suffix in ("", ".small"):
            for op in ("put", "get"):
                assert rows[f"tiers.{tier}.{op}_gbps{suffix}"]["unit"] == "GB/s"
                ratio = rows[f"tiers.{tier}.{op}_vs_raw{suffix}"]
                assert ratio["unit"] == "x" and ratio["baseline"] in rows and ratio["value"] > 0
                assert rows[f"tiers.{tier}.{op}_batch_vs_raw{suffix}"]["baseline"] == ratio["baseline"]
    assert result["params"]["scale"] == 0.001
    assert not list(tmp_path.glob("strata-bench-*"))  # the scratch directory is removed


def test_unknown_suite_is_an_error() -> None:
    failed = _run("no-such-suite")
    assert failed.returncode != 0 and "unknown suite" in failed.stderr
