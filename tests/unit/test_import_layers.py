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
        "scheduler_proc/own.py": (
            "from . import sibling\nfrom .sibling import y\nimport scheduler_proc.req\n"
        ),
        "scheduler_proc/typed.py": """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from tokenizer_proc.req_state import ReqState
            """,
        "detokenizer_proc/cli_user.py": "from tokenpipe import cli\n",
        "tokenizer_proc/dynamic.py": (
            "import importlib\nmod = importlib.import_module('detokenizer_proc.main')\n"
        ),
        "tokenpipe/cli.py": (
            "from pipeline.config import ServerConfig\n\n"
            "def main():\n    from scheduler_proc.main import run\n"
        ),
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
CIRCLE_RULE = (
    "modules import each other in a circle: "
    "move the shared type to the module that owns it or below both"
)


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
            f"{steps} -> {file_of(cycle[-1])} ({len(component)} files in the circle: {files}): "
            f"{CIRCLE_RULE}"
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
    assert "tokenizer_proc.tracing" in graph["tokenizer_proc.tracers"]  # under TYPE_CHECKING
    assert "tokenizer_proc.req_state" in graph["tokenizer_proc.http.sse_stream"]


def test_the_circle_checker_names_each_circle_with_files_and_lines(tmp_path: Path) -> None:
    sources = {
        "pipeline/__init__.py": "",
        "pipeline/a.py": "from pipeline.b import B\n",
        "pipeline/b.py": "import numpy\n\ndef f():\n    from pipeline import a\n",
        "scheduler_proc/__init__.py": "",
        "scheduler_proc/sub/__init__.py": "",
        "scheduler_proc/sub/x.py": (
            "from typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from scheduler_proc.y import Y\n"
        ),
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
        "pipeline/a.py:1 -> pipeline/b.py:4 -> pipeline/a.py (2 files in the circle: "
        f"pipeline/a.py, pipeline/b.py): {CIRCLE_RULE}",
        "scheduler_proc/sub/x.py:4 -> scheduler_proc/y.py:1 -> scheduler_proc/z.py:1 -> "
        "scheduler_proc/sub/x.py"
        " (3 files in the circle: scheduler_proc/sub/x.py, scheduler_proc/y.py, "
        "scheduler_proc/z.py): " + CIRCLE_RULE,
    ]


# --- Directions inside a process package -----------------------------------------------------

# (importer, imported, rule): a module at or under ``importer`` imports nothing at or under
# ``imported``. ``ROUTER_ONLY`` below is the one allowed exception.
DIRECTIONS = (
    (
        "tokenizer_proc.native",
        "tokenizer_proc.openai",
        "the native dialect does not import the OpenAI one: what both use lives in request_edge/",
    ),
    (
        "tokenizer_proc.openai",
        "tokenizer_proc.native",
        "the OpenAI dialect does not import the native one: what both use lives in request_edge/",
    ),
    (
        "tokenizer_proc.media",
        "tokenizer_proc.native",
        "media.py does not import the native dialect: its errors live in request_edge/",
    ),
    (
        "tokenizer_proc.http",
        "tokenizer_proc.openai",
        "http/ imports the OpenAI dialect only to include its routers (a *.routes module)",
    ),
    (
        "scheduler_proc.model",
        "scheduler_proc.batch",
        "model/ does not import batch/: the batch builds what the model reads",
    ),
    (
        "scheduler_proc.sampling",
        "scheduler_proc.batch",
        "sampling/ does not import batch/: the batch hands the sampler its columns",
    ),
    (
        "scheduler_proc.req",
        "scheduler_proc.pd",
        "req.py does not import pd/: the small types a Req holds live beside it",
    ),
    (
        "scheduler_proc.req",
        "scheduler_proc.cache",
        "req.py does not import cache/: the small types a Req holds live beside it",
    ),
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _router_only(importer: str, imported: str) -> bool:
    """http/ may include a dialect's router: import a module named ``routes`` of it."""
    return _under(importer, "tokenizer_proc.http") and imported.endswith(".routes")


def module_edges(root: Path) -> Iterator[tuple[str, int, str, str]]:
    """(file relative to root, line, importing module, imported module) for every import of
    the checked packages; ``from pkg import name`` names ``pkg.name`` when that is a module."""
    for top in CHECKED:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root)
            module = module_name(path, root)
            package = ".".join(relative.parent.parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, imported in imported_modules(path, package):
                names = [f"{imported}.{name}" for name in _from_import_names(tree, line)]
                modules = [name for name in names if _is_module(root, name)]
                for target in modules or [imported]:
                    yield relative.as_posix(), line, module, target


def _is_module(root: Path, name: str) -> bool:
    path = root / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def direction_violations(root: Path) -> list[str]:
    """One ``file:line: importer imports imported: the rule`` per import against DIRECTIONS."""
    found = []
    for file, line, importer, imported in module_edges(root):
        for source, target, rule in DIRECTIONS:
            if not (_under(importer, source) and _under(imported, target)):
                continue
            if _router_only(importer, imported):
                continue
            found.append(f"{file}:{line}: {importer} imports {imported}: {rule}")
    return found


def test_the_sources_keep_the_directions_inside_each_package() -> None:
    violations = direction_violations(REPO)
    assert not violations, "imports against a direction:\n" + "\n".join(violations)


def test_the_direction_checker_names_each_bad_import(tmp_path: Path) -> None:
    sources = {
        "tokenizer_proc/__init__.py": "",
        "tokenizer_proc/native/__init__.py": "",
        "tokenizer_proc/native/routes.py": "from tokenizer_proc.openai.schema import X\n",
        "tokenizer_proc/openai/__init__.py": "",
        "tokenizer_proc/openai/schema.py": (
            "def f():\n    from tokenizer_proc.native import routes\n"
        ),
        "tokenizer_proc/openai/routes.py": "router = 1\n",
        "tokenizer_proc/media.py": "from tokenizer_proc.native.routes import E\n",
        "tokenizer_proc/http/__init__.py": "",
        "tokenizer_proc/http/server.py": (
            "from tokenizer_proc.openai.routes import router\n"
            "from tokenizer_proc.openai import schema\n"
        ),
        "scheduler_proc/__init__.py": "",
        "scheduler_proc/batch/__init__.py": "",
        "scheduler_proc/batch/forward.py": "from scheduler_proc.model.llama import M\n",
        "scheduler_proc/model/__init__.py": "",
        "scheduler_proc/model/llama.py": "from scheduler_proc.batch.forward import F\n",
        "scheduler_proc/sampling/__init__.py": "",
        "scheduler_proc/sampling/sampler.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from scheduler_proc.batch import forward\n"
        ),
        "scheduler_proc/pd/__init__.py": "",
        "scheduler_proc/pd/state.py": "",
        "scheduler_proc/cache/__init__.py": "",
        "scheduler_proc/cache/radix_cache.py": "",
        "scheduler_proc/req.py": (
            "from scheduler_proc.pd.state import S\nimport scheduler_proc.cache.radix_cache\n"
        ),
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    rules = {(source, target): rule for source, target, rule in DIRECTIONS}
    tp, sp = "tokenizer_proc", "scheduler_proc"

    assert direction_violations(tmp_path) == [
        f"scheduler_proc/model/llama.py:1: {sp}.model.llama imports {sp}.batch.forward: "
        + rules[(f"{sp}.model", f"{sp}.batch")],
        f"scheduler_proc/req.py:1: {sp}.req imports {sp}.pd.state: "
        + rules[(f"{sp}.req", f"{sp}.pd")],
        f"scheduler_proc/req.py:2: {sp}.req imports {sp}.cache.radix_cache: "
        + rules[(f"{sp}.req", f"{sp}.cache")],
        f"scheduler_proc/sampling/sampler.py:3: {sp}.sampling.sampler imports {sp}.batch.forward: "
        + rules[(f"{sp}.sampling", f"{sp}.batch")],
        f"tokenizer_proc/http/server.py:2: {tp}.http.server imports {tp}.openai.schema: "
        + rules[(f"{tp}.http", f"{tp}.openai")],
        f"tokenizer_proc/media.py:1: {tp}.media imports {tp}.native.routes: "
        + rules[(f"{tp}.media", f"{tp}.native")],
        f"tokenizer_proc/native/routes.py:1: {tp}.native.routes imports {tp}.openai.schema: "
        + rules[(f"{tp}.native", f"{tp}.openai")],
        f"tokenizer_proc/openai/schema.py:2: {tp}.openai.schema imports {tp}.native.routes: "
        + rules[(f"{tp}.openai", f"{tp}.native")],
    ]
