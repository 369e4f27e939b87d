"""The `directory_fleet` suite's pure parts: its ramp and where its per-node rates come from."""

from __future__ import annotations

import json

import pytest

from benchmarks.suites import directory_fleet


@pytest.mark.parametrize(
    ("limit", "steps"),
    [(1, [1]), (4, [1, 2, 4]), (95, [1, 2, 4, 8, 16, 32, 64, 95]), (0, [])],
)
def test_the_ramp_doubles_and_ends_at_its_limit(limit, steps) -> None:
    assert list(directory_fleet._ramp(limit)) == steps


def test_the_multiturn_workload_gives_the_documented_shape() -> None:
    keys, touches, saved = directory_fleet._shape_from_workload()
    assert (round(keys, 2), round(touches, 2), round(saved, 2)) == (8.0, 6.33, 1.67)


def test_request_timelines_give_the_shape_when_kept(tmp_path) -> None:
    path = tmp_path / "strata_host-requests.json"
    requests = [
        {"prompt_tokens": 2048, "written_blocks": 8, "hit_blocks_by_tier": {}},
        {"prompt_tokens": 2300, "written_blocks": 1, "hit_blocks_by_tier": {"host": 6, "disk": 2}},
    ]
    path.write_text(json.dumps({"node": "n", "requests": requests}))
    assert directory_fleet._shape_from_traces(path) == (8.0, 4.0, 4.5)
    path.write_text(json.dumps({"node": "n", "requests": []}))
    assert directory_fleet._shape_from_traces(path) is None


def test_the_request_rate_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("STRATA_BENCH_FLEET_REQUESTS_PER_S", "40")
    offered = directory_fleet.offered_per_node()
    assert offered.requests_per_s == 40.0
    assert offered.sources["requests_per_s"] == "STRATA_BENCH_FLEET_REQUESTS_PER_S"
    monkeypatch.setenv("STRATA_BENCH_FLEET_REQUESTS_PER_S", "0")
    with pytest.raises(ValueError, match="STRATA_BENCH_FLEET_REQUESTS_PER_S"):
        directory_fleet.offered_per_node()


def test_the_setups_run_are_chosen_by_name_and_an_unknown_one_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("STRATA_BENCH_FLEET_SETUPS", "primary")
    assert directory_fleet.setups_chosen() == ["primary"]
    monkeypatch.setenv("STRATA_BENCH_FLEET_SETUPS", "primary,standby")
    with pytest.raises(ValueError, match="STRATA_BENCH_FLEET_SETUPS: unknown setup 'standby'"):
        directory_fleet.setups_chosen()
    monkeypatch.delenv("STRATA_BENCH_FLEET_SETUPS")
    assert directory_fleet.setups_chosen() == ["primary", "replica"]


def test_the_replica_setup_needs_the_embedded_server(monkeypatch) -> None:
    """Another server (DATABASE_URL) has no data directory to copy: asked for, the replica setup is
    refused by name; by default only the primary runs."""
    monkeypatch.setenv("DATABASE_URL", "postgresql://strata@db.example.com:5432/strata")
    monkeypatch.delenv("STRATA_BENCH_FLEET_SETUPS", raising=False)
    assert directory_fleet.setups_chosen() == ["primary"]
    monkeypatch.setenv("STRATA_BENCH_FLEET_SETUPS", "replica")
    with pytest.raises(ValueError, match="the replica setup starts a standby of the embedded PostgreSQL"):
        directory_fleet.setups_chosen()
