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


# ---- every file under a root is touched through one guarded module ---------------------------------------
# store/rootfs.py walks every path below a root by descriptors, never following a symlink; store/guard.py
# and store/fsops.py hold the primitives it is built on (and renameat2, fsync, which the torture suite patches). Any other module that opens, lists, renames or deletes by path could
# follow a symlinked component out of the root (round 2: a symlinked .peers made a save delete elsewhere).
_GUARDED = {"safepoint.store.rootfs", "safepoint.store.guard", "safepoint.store.fsops"}
_RAW_MODULE_CALLS = {
    *(f"os.{n}" for n in ("open", "rename", "replace", "renames", "makedirs", "mkdir", "listdir", "scandir")),
    *(f"os.{n}" for n in ("unlink", "remove", "rmdir", "removedirs")),
    *(f"os.path.{n}" for n in ("exists", "isfile", "isdir", "getsize")),
    *(f"shutil.{n}" for n in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree")),
}
# Path's methods that follow symlinks or touch the disk. The check is by name (the AST has no types), so
# RootDir names its own methods apart (isdir, lexists, makedirs, move, remove).
_RAW_METHODS = {
    "is_dir", "is_file", "exists", "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "mkdir",
    "unlink", "rename", "rmdir", "touch", "glob", "rglob", "symlink_to",
}  # fmt: skip
# (module, call) that may stay, each because it is not a path under a checkpoint root. Keep it short.
_ALLOWED: dict[tuple[str, str], str] = {
    ("safepoint.store.heartbeat", "open"): "reads /proc/<pid>/stat (a process's start time), not a root",
    ("safepoint.preempt.shield", "open"): "reads /proc/<pid>/status, not a root",
    ("safepoint.preempt.shield", "os.listdir"): "lists /proc/self/task, not a root",
    ("safepoint.preempt.notices", "os.remove"): "the user's preemption-notice file, not a root",
    ("safepoint.remote.io", ".rename"): "the upload recorder's note of DCP's rename: no file is touched",
    ("safepoint.store.storage", ".rename"): "the same note, for a local save: no file is touched",
    ("safepoint.cli.bench", ".is_dir"): "finds the repository's benchmarks folder, not a root",
    ("safepoint.cli.report", ".is_dir"): "checks the folder of the --plot file the user names, not a root",
    ("safepoint.events", "open"): "JsonlSink's file: a path the user names for a log, not a root",
}
# Whole modules that are not in the checkpoint's path: the demo's own run directory (it plays the attacker
# on purpose, flipping bytes in its checkpoints) and the CLI's export/import of user-named files.
_ALLOWED_MODULES: dict[str, str] = {
    "safepoint.demo": "the demo's run directory and its deliberate damage, never a user's root",
    "safepoint.cli.convert": "writes an export to a path the user names, outside any root",
    "safepoint.cli.tools_convert": "reads a user-named file to import and writes its export, outside any root",
    # The commit protocol (store/posix_layout.py, root_ops.py), DCP's writer (store/storage.py: DCP's
    # FileSystemWriter does every file access through its FileSystem object, which safepoint's subclass
    # routes through RootDir), the lease and the rank files are all on RootDir (issue 23); nothing is left.
}


def raw_file_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every raw file-system call in ``source`` (see _RAW_MODULE_CALLS/_RAW_METHODS)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            found.append((node.lineno, "open"))
        elif isinstance(f, ast.Attribute):
            dotted = ast.unparse(f)
            if dotted in _RAW_MODULE_CALLS:
                found.append((node.lineno, dotted))
            elif f.attr in _RAW_METHODS:
                found.append((node.lineno, f".{f.attr}"))
    return sorted(found)


def test_only_the_guarded_module_touches_files() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        if module in _GUARDED or any(module.startswith(m) for m in _ALLOWED_MODULES):
            continue
        for line, call in raw_file_calls(path.read_text()):
            if (module, call) not in _ALLOWED:
                offenders.append(f"{path.relative_to(SRC.parent)}:{line}: {call}")
    assert offenders == [], "use safepoint.store.rootfs.RootDir (docs/architecture.md):\n" + "\n".join(
        offenders
    )


def test_the_raw_call_finder_finds_raw_calls() -> None:
    snippet = (
        "import os, shutil\n"
        "def f(p, fs):\n"
        "    open(p)\n"
        "    os.rename(p, p)\n"
        "    shutil.rmtree(p)\n"
        "    if p.is_dir() and os.path.isfile(p):\n"
        "        p.read_text()\n"
        "    fs.isdir('x'); fs.read('x', 1); os.fdopen(3); 'a'.replace('a', 'b')\n"
    )
    assert raw_file_calls(snippet) == [
        (3, "open"), (4, "os.rename"), (5, "shutil.rmtree"), (6, ".is_dir"), (6, "os.path.isfile"),
        (7, ".read_text"),
    ]  # fmt: skip


def test_the_files_the_suite_starts_first_exist() -> None:
    """tests/conftest.py LONG_FIRST names files by path: a renamed one would silently drop to the end."""
    from tests.conftest import LONG_FIRST, REPO

    assert [p for p in LONG_FIRST if not (REPO / p).is_file()] == []


# ---- collecting the suite imports no framework -------------------------------------------------------------
# pytest-xdist's workers each import every test module (and conftest) to collect it, so a package imported at
# a test module's top is paid by every worker, though one worker runs that module's tests: lightning costs
# ~3 s of CPU a worker, transformers with peft ~3 s (tests/torture/README.md, "Collection"). Those imports
# go inside the tests, or into a helper module the tests import (tests/integrations/lightning_parts.py).
_COSTLY = {
    "accelerate", "aiobotocore", "boto3", "botocore", "lightning", "lightning_fabric", "matplotlib", "moto",
    "peft", "pytorch_lightning", "s3fs", "torchmetrics", "torchtitan", "transformers",
}  # fmt: skip
_REPO = SRC.parents[1]


def import_time_imports(source: str, package: str = "") -> list[tuple[int, str]]:
    """(line, module) of each import that running ``source`` does: at module level and in class bodies, not
    in functions nor under ``if TYPE_CHECKING:``; ``pytest.importorskip("m")`` imports m. For ``from a import
    b`` both ``a`` and ``a.b`` (b may be a module). ``package``: where a relative import starts."""
    found: set[tuple[int, str]] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                found.add((node.lineno, module))
                found.update((node.lineno, f"{module}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Expr | ast.Assign | ast.AnnAssign):
                for call in ast.walk(node):
                    if (
                        isinstance(call, ast.Call)
                        and ast.unparse(call.func) == "pytest.importorskip"
                        and call.args
                        and isinstance(call.args[0], ast.Constant)
                    ):
                        found.add((call.lineno, str(call.args[0].value)))
            elif isinstance(node, ast.ClassDef | ast.If | ast.With | ast.For | ast.While | ast.Try):
                # run at import (a function's body is not): every block of the statement
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source).body)
    return sorted(found)


def _module_file(module: str) -> Path | None:
    """The file of ``module`` if it is one of this checkout's (``tests.*`` or ``safepoint.*``)."""
    top = module.split(".")[0]
    if top not in ("tests", "safepoint"):
        return None
    path = (_REPO if top == "tests" else SRC.parent).joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def costly_collection_imports(starts: list[str]) -> list[str]:
    """Each import of a ``_COSTLY`` package that importing the modules ``starts`` runs, following the imports
    of this checkout's own modules (and the packages above them): ``file:line: package (via chain)``."""
    via: dict[str, str] = {m: "" for m in starts}
    todo, offenders = list(starts), []
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if path is None:
            continue
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        chain = f"{via[module]} -> {module}" if via[module] else module
        for line, name in import_time_imports(path.read_text(), package):
            where = f"{path.relative_to(_REPO)}:{line}: "
            if name.split(".")[0] in _COSTLY and not any(o.startswith(where) for o in offenders):
                offenders.append(f"{where}{name} (via {chain})")  # the line's first (shortest) name
            parents = name.split(".")
            for depth in range(1, len(parents) + 1):
                dotted = ".".join(parents[:depth])
                if dotted not in via:
                    via[dotted] = chain
                    todo.append(dotted)
    return sorted(offenders)


def test_collecting_the_suite_imports_no_framework() -> None:
    """No test module or conftest imports a framework or an object-store client when pytest collects it:
    every xdist worker collects every module (see _COSTLY)."""
    starts = [
        ".".join(p.relative_to(_REPO).with_suffix("").parts)
        for p in sorted((_REPO / "tests").rglob("*.py"))
        if p.name.startswith("test_") or p.name == "conftest.py"
    ]
    assert len(starts) > 100, starts  # the search finds the test modules
    offenders = costly_collection_imports(starts)
    assert offenders == [], "imported when pytest collects (import it inside the tests):\n" + "\n".join(
        offenders
    )


def test_the_import_finder_finds_what_runs_at_import() -> None:
    snippet = (
        "import os, lightning.pytorch as L\n"
        "from typing import TYPE_CHECKING\n"
        "import pytest\n"
        "pytest.importorskip('torchtitan.components')\n"
        "if TYPE_CHECKING:\n"
        "    import transformers\n"
        "else:\n"
        "    from . import parts\n"
        "try:\n"
        "    import s3fs\n"
        "except ImportError:\n"
        "    import boto3\n"
        "class A:\n"
        "    from accelerate import Accelerator\n"
        "    def f(self):\n"
        "        import peft\n"
        "def g():\n"
        "    import moto\n"
    )
    assert import_time_imports(snippet, "tests.integrations") == [
        (1, "lightning.pytorch"), (1, "os"), (2, "typing"), (2, "typing.TYPE_CHECKING"), (3, "pytest"),
        (4, "torchtitan.components"), (8, "tests.integrations"), (8, "tests.integrations.parts"),
        (10, "s3fs"), (12, "boto3"), (14, "accelerate"), (14, "accelerate.Accelerator"),
    ]  # fmt: skip
    # Through this checkout's modules: a helper that imports lightning itself, and a job script that imports
    # torchtitan through safepoint's integration.
    found = costly_collection_imports(
        ["tests.integrations.lightning_parts", "tests.integrations.torchtitan_job"]
    )
    assert any(f.startswith("tests/integrations/lightning_parts.py:") and ": lightning (" in f for f in found)
    via = "(via tests.integrations.torchtitan_job -> safepoint.integrations.torchtitan)"
    assert any(f.startswith("src/safepoint/integrations/torchtitan.py:") and f.endswith(via) for f in found)
