"""The layers, held by reading the sources: ``pipeline/`` is the ground floor and imports no
process package nor the command line; a process package (``scheduler_proc/``,
``detokenizer_proc/``, ``tokenizer_proc/``) imports no other process package nor the command
line; ``tokenpipe/`` (the command line) sits above them all.

Every import counts, wherever it is written: at the top, inside a function (a lazy import is
still a dependency), under ``if TYPE_CHECKING:``, and ``importlib.import_module("...")`` with
a literal name."""

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
        elif importer in PROCESS_PACKAGES and imported != importer and (imported in PROCESS_PACKAGES or imported == CLI):
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
