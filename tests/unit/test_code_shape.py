"""The shape a newcomer can read, held by reading the sources: no source file over 500
lines and no benchmark over 600, no function over 80 lines, module docstrings of 12 lines at
most. ``ruff format --check`` (``make check``) holds the 100-column width."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SOURCES = ("pipeline", "scheduler_proc", "detokenizer_proc", "tokenizer_proc", "tokenpipe")
MAX_SOURCE_LINES = 500
MAX_BENCH_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 12


def python_files(*tops: str) -> Iterator[Path]:
    for top in tops:
        yield from sorted((REPO / top).rglob("*.py"))


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_runs_past_500_lines() -> None:
    long = [
        f"{p.relative_to(REPO)}: {lines_of(p)} lines"
        for p in python_files(*SOURCES)
        if lines_of(p) > MAX_SOURCE_LINES
    ]
    assert not long, f"split these by job (at most {MAX_SOURCE_LINES} lines):\n" + "\n".join(long)


def test_no_benchmark_runs_past_600_lines() -> None:
    long = [
        f"{p.relative_to(REPO)}: {lines_of(p)} lines"
        for p in python_files("bench")
        if lines_of(p) > MAX_BENCH_LINES
    ]
    assert not long, f"split these (at most {MAX_BENCH_LINES} lines):\n" + "\n".join(long)


def long_functions(paths: Iterator[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(f"{where} {node.name}: {length} lines")
    return found


def test_no_source_function_runs_past_80_lines() -> None:
    long = long_functions(python_files(*SOURCES))
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_module_docstrings_keep_to_12_lines() -> None:
    long = []
    for path in python_files(*SOURCES, "bench"):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{path.relative_to(REPO)}: {len(doc.splitlines())} lines")
    assert not long, "keep the why and the invariants, move the rest:\n" + "\n".join(long)


def test_the_function_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    found = long_functions(iter([tmp_path / "m.py"]), root=tmp_path)
    assert [line.split(" ", 1)[1] for line in found] == [f"long: {MAX_FUNCTION_LINES + 1} lines"]
