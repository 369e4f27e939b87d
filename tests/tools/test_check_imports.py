"""The tree-shape check (tools/check_imports.py): rooms, and which imports it counts as running
back up the rooms' layering."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_imports", ROOT / "tools" / "check_imports.py")
assert spec is not None and spec.loader is not None
check_imports = importlib.util.module_from_spec(spec)
sys.modules["check_imports"] = check_imports
spec.loader.exec_module(check_imports)


def arrows(*pairs: tuple[str, str, int]) -> dict:
    return {(a, b): [(f"{a}.m{i}", f"{b}.n{i}") for i in range(n)] for a, b, n in pairs}


def test_a_module_lives_in_the_room_directly_inside_its_innermost_container():
    assert check_imports.room_of("worker.dataplane.tiers.disk.files") == "worker.dataplane.tiers"
    assert check_imports.room_of("worker.node") == "worker.node"
    assert check_imports.room_of("worker.dataplane") == "worker.dataplane"
    assert check_imports.room_of("controlplane.directory.services.blocks") == "controlplane.directory"
    assert check_imports.room_of("controlplane") is None
    assert check_imports.room_of("django.db") is None


def test_of_two_rooms_importing_each_other_the_thinner_arrow_runs_back_up():
    found = check_imports.back_arrows(arrows(("app.dash", "app.dir", 6), ("app.dir", "app.dash", 2)))
    assert found == [("app.dir", "app.dash")]


def test_in_a_circle_of_rooms_the_fewest_arrows_that_break_it_are_counted():
    # a -> b -> c -> d -> a, and a -> c: only d -> a lies on both circles.
    found = check_imports.back_arrows(
        arrows(("t.a", "t.b", 1), ("t.b", "t.c", 1), ("t.c", "t.d", 5), ("t.d", "t.a", 3), ("t.a", "t.c", 1))
    )
    assert found == [("t.d", "t.a")]


def test_rooms_in_an_order_have_no_arrow_running_back_up():
    assert check_imports.back_arrows(arrows(("t.a", "t.b", 1), ("t.b", "t.c", 1), ("t.a", "t.c", 2))) == []


def test_four_rooms_each_importing_the_others_need_six_arrows_gone():
    # Any order of four rooms leaves six of the twelve arrows pointing back.
    rooms = [f"t.r{i}" for i in range(4)]
    every = arrows(*[(a, b, 1) for a in rooms for b in rooms if a != b])
    found = check_imports.back_arrows(every)
    assert len(found) == 6
    assert check_imports._acyclic([a for a in every if a not in found])


def test_past_the_exact_search_the_circles_are_broken_greedily(monkeypatch):
    monkeypatch.setattr(check_imports, "EXACT_CHOICES", 10)
    rooms = [f"t.r{i}" for i in range(4)]
    every = arrows(*[(a, b, 1) for a in rooms for b in rooms if a != b])
    found = check_imports.back_arrows(every)
    assert len(found) >= 6
    assert check_imports._acyclic([a for a in every if a not in found])
