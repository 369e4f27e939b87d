"""The tree's shape, checked: no import cycle among the project's modules, no import that runs back
up the layering of rooms, and no module of the node runtime or the control plane past 600 lines
unless its docstring says why.

A room is a package or module directly inside one of the CONTAINERS (`controlplane.directory`,
`worker.dataplane.tiers`, `worker.node`, ...). Rooms import each other; where rooms import each
other round in a circle, the rooms have no order, and the imports that must go for the rooms to have
one (the fewest, and of those the thinnest, counted in module imports) are the ones that run back
up. Their count per tree must stay within BACK_ARROWS.

Every import counts, the ones inside functions too: a function-local import still ties the two
modules together, it only hides the tie from the reader. Run by `make lint`; exits non-zero and
names each cycle (its modules and one path round it) and each long module.
"""

from __future__ import annotations

import ast
import itertools
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import grimp

PACKAGES = ("controlplane", "worker", "benchmarks")
SIZED = ("controlplane", "worker")
MAX_LINES = 600
REASON = "Why one module:"
"""The phrase a long module's docstring starts its reason with."""


def cycles(graph: grimp.ImportGraph, modules: Iterable[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def round_trip(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """One path from the component's first module back to itself, through the component."""
    first = component[0]
    for nxt in sorted(graph.find_modules_directly_imported_by(first)):
        if nxt in component:
            back = graph.find_shortest_chain(importer=nxt, imported=first)
            if back:
                return [first, *back]
    return component


CONTAINERS = ("worker.dataplane", "worker", "controlplane", "benchmarks")
"""Packages whose direct children are rooms; the first that holds a module names its room."""
BACK_ARROWS = {"worker": 0, "controlplane": 0, "benchmarks": 0}
"""The most imports running back up the rooms' layering each tree may have."""
EXACT_CHOICES = 200_000
"""The fewest arrows to remove are found by trying every choice of 1, 2, ... arrows while the choices
of that many number at most this; past it, greedily."""

Arrow = tuple[str, str]


def room_of(module: str) -> str | None:
    """The room a module lives in: its ancestor directly inside the innermost container."""
    for container in CONTAINERS:
        if module == container:
            return module if "." in module else None
        if module.startswith(container + "."):
            return container + "." + module[len(container) + 1 :].split(".")[0]
    return None


def room_arrows(graph: grimp.ImportGraph, modules: Iterable[str]) -> dict[Arrow, list[tuple[str, str]]]:
    """Every import between two rooms of the same tree, grouped by (importing room, imported room)."""
    arrows: dict[Arrow, list[tuple[str, str]]] = defaultdict(list)
    for module in sorted(modules):
        source = room_of(module)
        if source is None:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            target = room_of(imported)
            if target and target != source and target.split(".")[0] == source.split(".")[0]:
                arrows[(source, target)].append((module, imported))
    return arrows


def _acyclic(arrows: Iterable[Arrow]) -> bool:
    after: dict[str, set[str]] = defaultdict(set)
    incoming: dict[str, int] = defaultdict(int)
    rooms: set[str] = set()
    for a, b in arrows:
        if b not in after[a]:
            after[a].add(b)
            incoming[b] += 1
        rooms.update((a, b))
    ready = [r for r in rooms if incoming[r] == 0]
    seen = 0
    while ready:
        room = ready.pop()
        seen += 1
        for nxt in after[room]:
            incoming[nxt] -= 1
            if incoming[nxt] == 0:
                ready.append(nxt)
    return seen == len(rooms)


def _in_circles(arrows: list[Arrow]) -> int:
    """How many of the arrows lie on a circle (their head reaches their tail)."""
    after: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        after[a].add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in after[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sum(1 for a, b in arrows if reaches(b, a))


def back_arrows(arrows: dict[Arrow, list[tuple[str, str]]]) -> list[Arrow]:
    """The arrows that run back up: in each circle of rooms, the fewest whose removal leaves the rooms
    an order (of equal counts, the set with the fewest module imports)."""
    found: list[Arrow] = []
    rooms = sorted({r for arrow in arrows for r in arrow})
    graph = grimp.ImportGraph()
    for room in rooms:
        graph.add_module(room)
    for a, b in arrows:
        graph.add_import(importer=a, imported=b)
    for component in cycles(graph, rooms):
        inside = [arrow for arrow in arrows if arrow[0] in component and arrow[1] in component]
        weight = {arrow: len(arrows[arrow]) for arrow in inside}
        best: list[Arrow] | None = None
        for size in range(1, len(inside) + 1):
            if math.comb(len(inside), size) > EXACT_CHOICES:
                break
            for removed in itertools.combinations(inside, size):
                rest = [arrow for arrow in inside if arrow not in removed]
                if _acyclic(rest) and (best is None or sum(map(weight.get, removed)) < sum(map(weight.get, best))):
                    best = list(removed)
            if best is not None:
                break
        if best is None:  # greedy: drop the arrow whose going leaves the fewest arrows in circles
            best, rest = [], list(inside)
            while not _acyclic(rest):
                drop = min(rest, key=lambda a: (_in_circles([x for x in rest if x != a]), weight[a], a))
                rest.remove(drop)
                best.append(drop)
        found.extend(best)
    return sorted(found)


def long_modules(root: Path) -> list[tuple[Path, int]]:
    """Modules past MAX_LINES whose docstring gives no reason."""
    found = []
    for package in SIZED:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            text = path.read_text()
            lines = text.count("\n")
            if lines <= MAX_LINES:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if REASON not in doc:
                found.append((path.relative_to(root), lines))
    return found


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    modules = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    failed = False
    for component in cycles(graph, modules):
        failed = True
        print(f"import cycle among {len(component)} modules: {', '.join(component)}")
        print("  for example: " + " -> ".join(round_trip(graph, component)))
    arrows = room_arrows(graph, modules)
    back = back_arrows(arrows)
    for tree, limit in BACK_ARROWS.items():
        mine = [arrow for arrow in back if arrow[0].split(".")[0] == tree]
        print(f"{tree}: {len(mine)} import(s) running back up the rooms' layering (at most {limit})")
        for source, target in mine:
            imports = ", ".join(f"{m} -> {n}" for m, n in arrows[(source, target)])
            print(f"  {source} -> {target}: {imports}")
        if len(mine) > limit:
            failed = True
    for path, lines in long_modules(root):
        failed = True
        print(f"{path}: {lines} lines (more than {MAX_LINES}); split it, or say why in its docstring with {REASON!r}")
    if not failed:
        print(
            f"no import cycle among {len(modules)} modules; no room importing back up; "
            f"no module past {MAX_LINES} lines without a reason"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
