"""The layers, held by reading the sources: ``pipeline/`` is the ground floor and imports no
process package nor the command line; a process package (``scheduler_proc/``,
``detokenizer_proc/``, ``tokenizer_proc/``) imports no other process package nor the command
line; ``tokenpipe/`` (the command line) sits above them all.

Every import counts, wherever it is written: at the top, inside a function (a lazy import is
still a dependency), under ``if TYPE_CHECKING:``, and ``importlib.import_module("...")`` with
a literal name.

Inside a package too, no two modules import each other, directly or round a longer circle
(``import_circles``): a type two modules share lives in the one that owns it or in a small
module below both, so each file can be read after the files it imports."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GROUND = "pipeline"
PROCESS_PACKAGES = frozenset({"scheduler_proc", "detokenizer_proc", "tokenizer_proc"})
CLI = "tokenpipe"
CHECKED = (GROUND, *sorted(PROCESS_PACKAGES), CLI)

GROUND_RULE = "pipeline/ is the ground floor: it imports no process package and not tokenpipe"
PROCESS_RULE = "a process package imports no other process package and not tokenpipe"


def imported_modules(path: Path, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; ``package`` is the file's
    dotted package, against which relative imports are resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                yield node.lineno, f"{base}.{node.module}" if node.module else base
            else:
                yield node.lineno, node.module or ""
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def import_graph(root: Path) -> Iterator[tuple[str, int, str, str]]:
    """(file relative to root, line, importing top-level package, imported top-level package)
    for every import in every .py file of the checked packages under ``root``."""
    for top in CHECKED:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root)
            package = ".".join(relative.parent.parts)
            for line, module in imported_modules(path, package):
                yield relative.as_posix(), line, top, module.split(".")[0]


def layer_violations(root: Path) -> list[str]:
    """One ``file:line: what imports what: the rule`` per import that breaks a layer rule."""
    found = []
    for file, line, importer, imported in import_graph(root):
        if importer == GROUND and (imported in PROCESS_PACKAGES or imported == CLI):
            found.append(f"{file}:{line}: {importer} imports {imported}: {GROUND_RULE}")
        elif (
            importer in PROCESS_PACKAGES
            and imported != importer
            and (imported in PROCESS_PACKAGES or imported == CLI)
        ):
            found.append(f"{file}:{line}: {importer} imports {imported}: {PROCESS_RULE}")
    return found


def test_the_sources_keep_the_layers() -> None:
    violations = layer_violations(REPO)
    assert not violations, "imports across layers:\n" + "\n".join(violations)


def test_the_checker_sees_the_imports_the_layers_are_made_of() -> None:
    """Guards against passing vacuously (no files found, or imports missed)."""
    edges = {(importer, imported) for _, _, importer, imported in import_graph(REPO)}
    for process in PROCESS_PACKAGES:
        assert (process, GROUND) in edges, f"{process} should import pipeline somewhere"
    # The command line imports each process's main inside a function, lazily.
    for process in PROCESS_PACKAGES:
        assert (CLI, process) in edges, f"tokenpipe should import {process} (inside main())"
    assert (CLI, GROUND) in edges


def test_the_checker_names_each_broken_rule_with_file_and_line(tmp_path: Path) -> None:
    sources = {
        "pipeline/__init__.py": "",
        "pipeline/ok.py": "import numpy\nfrom pipeline.io_struct import X\n",
        "pipeline/lazy.py": """\
            def f():
                from scheduler_proc.main import run
            """,
        "pipeline/entry.py": "import tokenpipe.cli\n",
        "scheduler_proc/__init__.py": "",
        "scheduler_proc/own.py": "from . import sibling\nfrom .sibling import y\nimport scheduler_proc.req\n",
        "scheduler_proc/typed.py": """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from tokenizer_proc.req_state import ReqState
            """,
        "detokenizer_proc/cli_user.py": "from tokenpipe import cli\n",
        "tokenizer_proc/dynamic.py": "import importlib\nmod = importlib.import_module('detokenizer_proc.main')\n",
        "tokenpipe/cli.py": "from pipeline.config import ServerConfig\n\ndef main():\n    from scheduler_proc.main import run\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))

    assert layer_violations(tmp_path) == [
        f"pipeline/entry.py:1: pipeline imports tokenpipe: {GROUND_RULE}",
        f"pipeline/lazy.py:2: pipeline imports scheduler_proc: {GROUND_RULE}",
        f"detokenizer_proc/cli_user.py:1: detokenizer_proc imports tokenpipe: {PROCESS_RULE}",
        f"scheduler_proc/typed.py:4: scheduler_proc imports tokenizer_proc: {PROCESS_RULE}",
        f"tokenizer_proc/dynamic.py:2: tokenizer_proc imports detokenizer_proc: {PROCESS_RULE}",
    ]


# --- Circles between modules ---------------------------------------------------------------

# The benchmarks too: a circle reads as badly there.
CIRCLE_CHECKED = (*CHECKED, "bench")
CIRCLE_RULE = "modules import each other in a circle: move the shared type to the module that owns it or below both"


def module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def module_imports(root: Path) -> dict[str, dict[str, int]]:
    """For each module of the checked packages under ``root``: the checked modules it imports
    (every import counts, as above), each with the first line that imports it. ``from pkg import
    name`` names the module ``pkg.name`` when there is one, else ``pkg``."""
    paths = {
        module_name(path, root): path
        for top in CIRCLE_CHECKED
        for path in sorted((root / top).rglob("*.py"))
        if (root / top).is_dir()
    }
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        package = ".".join(path.relative_to(root).parent.parts)
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, imported in imported_modules(path, package):
            targets = [imported]
            node_names = _from_import_names(tree, line)
            targets += [f"{imported}.{name}" for name in node_names]
            for target in targets:
                if target in paths and target != module:
                    edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _from_import_names(tree: ast.Module, line: int) -> list[str]:
    return [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.lineno == line
        for alias in node.names
    ]


def import_circles(root: Path) -> list[str]:
    """One line per circle of imports between modules (a strongly connected set of two or more
    modules), naming one cycle through it as ``file:line`` steps, and every module it holds."""
    graph = module_imports(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm; the graphs are small enough to recurse
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)

    def file_of(module: str) -> str:
        path = root / module.replace(".", "/")
        return (
            f"{module.replace('.', '/')}/__init__.py"
            if path.is_dir()
            else f"{module.replace('.', '/')}.py"
        )

    found = []
    for component in sorted(components):
        members = set(component)
        cycle = _one_cycle(graph, component[0], members)
        steps = " -> ".join(f"{file_of(a)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:]))
        files = ", ".join(file_of(m) for m in component)
        found.append(
            f"{steps} -> {file_of(cycle[-1])} ({len(component)} files in the circle: {files}): {CIRCLE_RULE}"
        )
    return found


def _one_cycle(graph: dict[str, dict[str, int]], start: str, members: set[str]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target not in members:
                    continue
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in previous:
                    previous[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a circle but no cycle through it was found")


def test_no_module_imports_itself_round_a_circle() -> None:
    circles = import_circles(REPO)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_circle_checker_sees_module_imports() -> None:
    """Guards against passing vacuously: edges inside a package are found, lazy and
    TYPE_CHECKING ones included."""
    graph = module_imports(REPO)
    assert "scheduler_proc.req" in graph["scheduler_proc.scheduler"]
    assert "scheduler_proc.dllm_block" in graph["scheduler_proc.req"]
    assert (
        "scheduler_proc.batch.running_batch" in graph["scheduler_proc.sampling.logprobs"]
    )  # under TYPE_CHECKING
    assert "tokenizer_proc.req_state" in graph["tokenizer_proc.http.sse_stream"]


def test_the_circle_checker_names_each_circle_with_files_and_lines(tmp_path: Path) -> None:
    sources = {
        "pipeline/__init__.py": "",
        "pipeline/a.py": "from pipeline.b import B\n",
        "pipeline/b.py": "import numpy\n\ndef f():\n    from pipeline import a\n",
        "scheduler_proc/__init__.py": "",
        "scheduler_proc/sub/__init__.py": "",
        "scheduler_proc/sub/x.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from scheduler_proc.y import Y\n",
        "scheduler_proc/y.py": "from .z import Z\n",
        "scheduler_proc/z.py": "import scheduler_proc.sub.x\n",
        "scheduler_proc/leaf.py": "from scheduler_proc.y import Y\nfrom scheduler_proc import z\n",
        "tokenizer_proc/__init__.py": "",
        "tokenizer_proc/fine.py": "from tokenizer_proc.other import thing\n",
        "tokenizer_proc/other.py": "thing = 1\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    assert import_circles(tmp_path) == [
        f"pipeline/a.py:1 -> pipeline/b.py:4 -> pipeline/a.py (2 files in the circle: pipeline/a.py, pipeline/b.py): {CIRCLE_RULE}",
        "scheduler_proc/sub/x.py:4 -> scheduler_proc/y.py:1 -> scheduler_proc/z.py:1 -> scheduler_proc/sub/x.py"
        " (3 files in the circle: scheduler_proc/sub/x.py, scheduler_proc/y.py, scheduler_proc/z.py): "
        + CIRCLE_RULE,
    ]
