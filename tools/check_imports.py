"""The tree's shape, checked: no import cycle among the project's modules, and no module of the
node runtime or the control plane past 600 lines unless its docstring says why.

Every import counts, the ones inside functions too: a function-local import still ties the two
modules together, it only hides the tie from the reader. Run by `make lint`; exits non-zero and
names each cycle (its modules and one path round it) and each long module.
"""

from __future__ import annotations

import ast
import sys
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
    for path, lines in long_modules(root):
        failed = True
        print(f"{path}: {lines} lines (more than {MAX_LINES}); split it, or say why in its docstring with {REASON!r}")
    if not failed:
        print(f"no import cycle among {len(modules)} modules; no module past {MAX_LINES} lines without a reason")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
