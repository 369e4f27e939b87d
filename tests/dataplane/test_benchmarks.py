"""The benchmark harness runs the `tiers` suite end to end (tiny size) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


# -- a run that lacks rows fails -------------------------------------------------------------------
def _suite(rows: list, *, expected: tuple[str, ...] = ("fake.*",), failed: dict | None = None):
    """A suite module of the unit tests: yields `rows`, reports `failed` configurations."""
    import types

    def run(ctx):
        if failed is not None:
            ctx.params["failed"] = failed
        return rows

    return types.SimpleNamespace(run=run, EXPECTED_ROWS=expected, DESCRIPTION="fake")


def _main_with(monkeypatch, tmp_path, module) -> int:
    from benchmarks import harness

    monkeypatch.setattr(harness, "discover", lambda: ["fake"])
    monkeypatch.setattr(harness, "load", lambda name: module)
    return harness.main(["--smoke", "--results", str(tmp_path), "--scratch", str(tmp_path)])


def test_a_whole_run_passes(monkeypatch, tmp_path) -> None:
    from benchmarks.harness import Row

    rows = [Row("fake.host.put_gbps", 1.0, "GB/s"), Row("fake.disk.put_gbps", 2.0, "GB/s")]
    module = _suite(rows, expected=("fake.host.*", "fake.disk.*"))
    assert _main_with(monkeypatch, tmp_path, module) == 0
    result = json.loads((tmp_path / "fake.json").read_text())
    assert result["incomplete"] == [] and result["params"]["scale"] == 0.01 and result["params"]["repeats"] == 1


def test_a_suite_without_rows_fails_the_run(monkeypatch, tmp_path, capsys) -> None:
    assert _main_with(monkeypatch, tmp_path, _suite([])) == 1
    assert "suite fake is incomplete: it produced no rows" in capsys.readouterr().out
    assert json.loads((tmp_path / "fake.json").read_text())["incomplete"] == ["it produced no rows"]


def test_a_configuration_without_rows_fails_the_run(monkeypatch, tmp_path, capsys) -> None:
    from benchmarks.harness import Row

    module = _suite([Row("fake.host.put_gbps", 1.0, "GB/s")], expected=("fake.host.*", "fake.disk.*"))
    assert _main_with(monkeypatch, tmp_path, module) == 1
    assert "no row matches fake.disk.*" in capsys.readouterr().out


def test_a_configuration_reported_failed_fails_the_run(monkeypatch, tmp_path, capsys) -> None:
    from benchmarks.harness import Row

    module = _suite([Row("fake.host.put_gbps", 1.0, "GB/s")], failed={"disk": "RuntimeError: no space"})
    assert _main_with(monkeypatch, tmp_path, module) == 1
    assert "configuration disk failed: RuntimeError: no space" in capsys.readouterr().out


def test_every_suite_declares_the_rows_it_must_produce() -> None:
    from benchmarks import harness

    for name in harness.discover():
        module = harness.load(name)  # raises when a suite declares none
        context = harness.Context(scale=harness.SMOKE_SCALE, repeats=1, scratch=Path("."))
        assert harness.expected_rows(module, context), name


def test_the_vllm_suite_runs_the_workloads_chosen_and_refuses_an_unknown_one_by_name(monkeypatch) -> None:
    from benchmarks.suites import vllm as suite

    monkeypatch.setenv("STRATA_BENCH_VLLM_CONFIGS", "vllm_tp2,strata_host_tp2")
    monkeypatch.setenv("STRATA_BENCH_VLLM_WORKLOADS", "multiturn.c8")
    assert suite.expected_rows(None) == [  # type: ignore[arg-type]
        "vllm.multiturn.c8.vllm_tp2.ttft_mean_s",
        "vllm.multiturn.c8.strata_host_tp2.ttft_mean_s",
        "vllm.multiturn.c8.strata_host_tp2.ttft_vs_vllm_tp2",
    ]
    monkeypatch.setenv("STRATA_BENCH_VLLM_WORKLOADS", "nohit, multiturn.c9")
    with pytest.raises(ValueError, match=r"unknown workload\(s\) multiturn\.c9; expected some of multiturn\.c4"):
        suite.chosen_workloads()
    monkeypatch.delenv("STRATA_BENCH_VLLM_WORKLOADS")
    assert suite.chosen_workloads() == ["multiturn.c4", "multiturn.c8", "longdoc", "nohit", "rag"]


def test_the_rag_workload_runs_on_vllm_prefix_reuse_and_fragment_reuse_with_their_rows(monkeypatch) -> None:
    from benchmarks.suites import vllm as suite

    monkeypatch.setenv("STRATA_BENCH_VLLM_CONFIGS", "strata_blend,vllm,strata_disk")
    monkeypatch.setenv("STRATA_BENCH_VLLM_WORKLOADS", "rag,nohit")
    rows = suite.expected_rows(None)  # type: ignore[arg-type]
    # strata_blend runs the RAG workload alone; strata_disk does not run it.
    assert "vllm.nohit.strata_blend.ttft_mean_s" not in rows
    assert "vllm.nohit.strata_disk.ttft_mean_s" in rows
    assert not [row for row in rows if row.startswith("vllm.rag.strata_disk")]
    assert [row for row in rows if row.startswith("vllm.rag.")] == [
        "vllm.rag.vllm.ttft_mean_s",
        "vllm.rag.vllm.reused_tokens",
        "vllm.rag.vllm.accuracy_pct",
        "vllm.rag.strata_blend.ttft_mean_s",
        "vllm.rag.strata_blend.reused_tokens",
        "vllm.rag.strata_blend.accuracy_pct",
        "vllm.rag.strata_blend.ttft_vs_vllm",
        "vllm.rag.strata_blend.reused_vs_vllm",
        "vllm.rag.strata_blend.accuracy_delta_pts_vs_vllm",
    ]


def test_rag_prompts_share_the_header_and_draw_the_corpus_passages_in_new_orders() -> None:
    from benchmarks.workloads.sessions import Shape, rag_sessions

    shape = Shape()
    warm, asked = rag_sessions(shape, seed=50)
    prompts = [session[0](None)[0] for session in [*warm, *asked]]
    header = prompts[0][: shape.rag_header_tokens]
    size = shape.rag_passage_tokens
    passages = set()
    for prompt in prompts[: len(warm)]:
        body = prompt[shape.rag_header_tokens : -shape.rag_question_tokens]
        passages.update(tuple(body[i : i + size]) for i in range(0, len(body), size))
    assert len(warm) == shape.rag_corpus // shape.rag_passages + shape.rag_untimed
    assert len(passages) == shape.rag_corpus
    assert len(asked) == shape.rag_prompts
    orders = set()
    for prompt in prompts:
        assert prompt[: shape.rag_header_tokens] == header
        assert len(prompt) == shape.rag_header_tokens + shape.rag_passages * size + shape.rag_question_tokens
    for prompt in prompts[len(warm) :]:
        body = prompt[shape.rag_header_tokens : -shape.rag_question_tokens]
        drawn = [tuple(body[i : i + size]) for i in range(0, len(body), size)]
        assert set(drawn) <= passages and len(set(drawn)) == shape.rag_passages  # every one read in the warm-up
        orders.add(tuple(drawn))
    assert len(orders) == len(asked)


def test_rag_rows_compare_fragment_reuse_with_vllm_and_prefix_reuse() -> None:
    from benchmarks.suites.vllm import rag_rows

    def numbers(ttft: float, reused: float, accuracy: float) -> dict[str, dict[str, float]]:
        return {
            "rag": {
                "ttft_mean_s": ttft,
                "cached_tokens_mean": reused,
                "accuracy_pct": accuracy,
                "accuracy_reused_tokens": reused,
            }
        }

    rows = {
        row.name: row.value
        for row in rag_rows(
            {
                "vllm": numbers(4.0, 0.0, 98.0),
                "strata_host": numbers(4.2, 256.0, 98.0),
                "strata_blend": numbers(1.8, 4352.0, 97.0),
            }
        )
    }
    assert rows["vllm.rag.strata_blend.ttft_vs_vllm"] == pytest.approx(0.45)
    assert rows["vllm.rag.strata_blend.ttft_vs_strata_host"] == pytest.approx(1.8 / 4.2)
    assert rows["vllm.rag.strata_blend.reused_vs_strata_host"] == pytest.approx(17.0)
    assert rows["vllm.rag.strata_blend.reused_vs_vllm"] == pytest.approx(4352.0)  # nothing reused: divided by 1
    assert rows["vllm.rag.strata_blend.accuracy_delta_pts_vs_vllm"] == pytest.approx(1.0)
    assert rows["vllm.rag.vllm.accuracy_pct"] == 98.0
    # Without strata_blend, only each configuration's own rows.
    alone = rag_rows({"vllm": numbers(4.0, 0.0, 98.0)})
    assert [row.name for row in alone] == ["vllm.rag.vllm.reused_tokens", "vllm.rag.vllm.accuracy_pct"]
