"""The house shows the architecture: rooms along the data flow, no cycles, no oversized modules.

The layering itself (what may import what) is import-linter's contract in pyproject.toml, run by
``make lint``; this file checks what a layers contract cannot: two modules of one room importing each
other, and module size.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import safepoint

SRC = Path(safepoint.__file__).parent
MAX_LINES = 420  # "~400": a split made only to pass a count helps nobody


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def test_no_module_imports_itself_through_another() -> None:
    graph = grimp.build_graph("safepoint")
    # A package's __init__ importing its own modules is how the public API is built, not a cycle of rooms.
    for pkg in {m for m in graph.modules if (SRC.parent / m.replace(".", "/") / "__init__.py").exists()}:
        for child in graph.find_modules_directly_imported_by(pkg):
            graph.remove_import(importer=pkg, imported=child)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_every_room_is_a_subpackage_and_no_module_is_oversized() -> None:
    top = {p.stem for p in SRC.glob("*.py")}
    rooms = {"__init__", "_version", "manager", "emergency", "state", "errors", "dist", "options", "events"}
    assert top <= rooms, top
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_paths_computed_from_a_module_file_point_where_they_mean() -> None:
    """A module moved into a room keeps paths it derives from ``__file__`` right (caught after the move)."""
    from safepoint.cli import bench
    from safepoint.save import writer_process

    assert (Path(writer_process.PACKAGE_ROOT) / "safepoint" / "__init__.py").is_file()
    assert Path(writer_process.PACKAGE_ROOT) == SRC.parent
    assert "parents[3]" in Path(bench.__file__).read_text() and (SRC.parents[1] / "benchmarks").is_dir()


# Scripts that end through the interpreter's teardown on purpose: run by hand, never by the suite.
_BY_HAND = {"tests/dist/bench_agreement.py", "tests/dist_preempt/cost.py"}
_ENDINGS = {"run_then_exit", "run_plan", "exit_now", "_exit"}  # _exit: os._exit, in examples and the demo


def _main_block_calls(path: Path) -> set[str]:
    """The names called in ``path``'s ``if __name__ == "__main__":`` block (empty if it has none)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return {
                call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                for call in ast.walk(node)
                if isinstance(call, ast.Call)
            }
    return set()


def test_every_process_group_script_ends_without_the_interpreters_teardown() -> None:
    """torch 2.13's gloo threads can abort the teardown (tests/helpers/procs/exiting.py): every script of the
    suite, example and demo that starts a process group ends its ``__main__`` block without it."""
    root = SRC.parents[1]
    scripts = [
        p
        for folder in ("tests", "examples", "benchmarks", "src/safepoint/demo")
        for p in sorted((root / folder).rglob("*.py"))
        if ("init_process_group(" in (text := p.read_text()) or "run_plan(" in text)
        and not p.name.startswith("test_")
    ]
    ending = [p for p in scripts if (calls := _main_block_calls(p)) and not calls & _ENDINGS]
    assert len(scripts) > 10, scripts  # the search finds the workers
    assert [str(p.relative_to(root)) for p in ending if str(p.relative_to(root)) not in _BY_HAND] == []
