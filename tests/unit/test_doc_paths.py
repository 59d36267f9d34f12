"""Every module the prose names exists: the docs (README.md, docs/, bench/README.md, deploy/)
and the code's docstrings and comments name files by path (``scheduler_proc/req.py``), by
file name (``req.py``) and by dotted name (``scheduler_proc.req.Req``). When a module moves
or is renamed, each such reference has to follow it; this test finds the ones that did not.
So for the docs' links: each points to a file of the repository (never outside it) and, with
an anchor, to a heading that file has."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

OUR_TOPS = (
    "pipeline",
    "scheduler_proc",
    "detokenizer_proc",
    "tokenizer_proc",
    "tokenpipe",
    "bench",
    "tests",
    "scripts",
    "deploy",
    "docs",
)
PROSE = ("README.md", "docs", "bench/README.md", "deploy")
CODE = (
    "pipeline",
    "scheduler_proc",
    "detokenizer_proc",
    "tokenizer_proc",
    "tokenpipe",
    "bench",
    "tests",
    "scripts",
)
# Not ``tokenpipe``: ``tokenpipe.*`` is also the namespace of the span attributes.
PACKAGES = ("pipeline", "scheduler_proc", "detokenizer_proc", "tokenizer_proc", "bench")

# Files the prose names that are other projects' (what tokenpipe is compared with or reaches into).
OTHER_PROJECTS_FILES = frozenset(
    {
        "httptools_impl.py",
        "core.py",
        "tokenizer_manager.py",
        "scheduler.py",
        "__init__.py",
        "setup.py",
        "conftest.py",
    }
)

PATH = re.compile(
    r"(?<![\w./-])((?:"
    + "|".join(OUR_TOPS)
    + r")/(?:[\w.-]+/)*[\w-]+\.(?:py|md|json|conf|yml|yaml))(?![\w/])"
)
FILE_NAME = re.compile(r"(?<![\w./-])([a-z_][\w]*\.py)(?![\w/])")
DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")


def prose_files(root: Path) -> Iterator[Path]:
    for name in PROSE:
        path = root / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from sorted(
                p for p in path.rglob("*") if p.suffix in {".md", ".conf", ".yml", ".yaml"}
            )


def code_texts(root: Path) -> Iterator[tuple[Path, int, str]]:
    """(file, line, text) of every docstring and comment of the Python sources."""
    for top in CODE:
        for path in sorted((root / top).rglob("*.py")):
            source = path.read_text()
            tree = ast.parse(source)
            for node in ast.walk(tree):
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                ):
                    doc = ast.get_docstring(node, clean=False)
                    if doc and node.body:
                        yield path, node.body[0].lineno, doc
            for number, line in enumerate(source.splitlines(), 1):
                if "#" in line:
                    yield path, number, line[line.index("#") :]


def texts(root: Path) -> Iterator[tuple[Path, int, str]]:
    for path in prose_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield path, number, line
    yield from code_texts(root)


def top_level_names(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def dotted_problem(root: Path, name: str) -> str | None:
    """Why ``name`` (``pkg.module.attr...``) names nothing, or None when it resolves: each
    part a package or module until a module, then the first attribute defined in it."""
    parts = name.split(".")
    at = root / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if (at / part).is_dir() and (at / part / "__init__.py").exists():
            at = at / part
            continue
        if (at / f"{part}.py").is_file():
            module = at / f"{part}.py"
            rest = parts[i + 1 :]
            if rest and rest[0] not in top_level_names(module):
                return f"{module.relative_to(root)} defines no {rest[0]}"
            return None
        return f"{at.relative_to(root)}/ holds no module or package {part}"
    return None


def dangling(root: Path) -> list[str]:
    file_names = {
        p.name for top in OUR_TOPS if (root / top).is_dir() for p in (root / top).rglob("*.py")
    }
    found = []
    for path, number, text in texts(root):
        where = f"{path.relative_to(root)}:{number}"
        for ref in PATH.findall(text):
            if not (root / ref).exists():
                found.append(f"{where}: {ref} does not exist")
        for ref in FILE_NAME.findall(text):
            if ref not in file_names and ref not in OTHER_PROJECTS_FILES:
                found.append(f"{where}: no file is named {ref}")
        for ref in DOTTED.findall(text):
            problem = dotted_problem(root, ref.rstrip("."))
            if problem:
                found.append(f"{where}: {ref}: {problem}")
    return found


MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (``## 14. Where things live``:
    ``14-where-things-live``; a repeated heading gets ``-1``, ``-2``...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(root: Path) -> list[str]:
    found = []
    for path in prose_files(root):
        if path.suffix != ".md":
            continue
        for target in MARKDOWN_LINK.findall(FENCE.sub("", path.read_text())):
            where = f"{path.relative_to(root)}: {target}"
            if re.match(r"^[a-z]+:|^//", target):
                found.append(f"{where}: points outside the repository")
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.is_relative_to(root.resolve()) or not linked.exists():
                found.append(f"{where}: no such file in the repository")
            elif anchor and (linked.suffix != ".md" or anchor not in heading_anchors(linked)):
                found.append(f"{where}: {linked.name} has no heading with that anchor")
    return found


def test_every_link_in_the_docs_resolves_inside_the_repository() -> None:
    problems = broken_links(REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "# Design\n\n## 14. Where things live\n\n## Notes\n\n## Notes\n"
    )
    (tmp_path / "README.md").write_text(
        "[ok](docs/design.md#14-where-things-live) [ok](docs/design.md#notes-1) [ok](#readme)\n"
        "[a](docs/design.md#15-gone) [b](docs/api.md) [c](https://example.com) [d](../outside.md)\n"
        "```\n[in code](nowhere.md)\n```\n# README\n"
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/design.md#15-gone: design.md has no heading with that anchor",
        "README.md: docs/api.md: no such file in the repository",
        "README.md: https://example.com: points outside the repository",
        "README.md: ../outside.md: no such file in the repository",
    ]


def test_every_module_the_docs_and_docstrings_name_exists() -> None:
    problems = dangling(REPO)
    assert not problems, "references to modules that do not exist:\n" + "\n".join(problems)


def test_the_checker_finds_dangling_references(tmp_path: Path) -> None:
    (tmp_path / "scheduler_proc" / "cache").mkdir(parents=True)
    (tmp_path / "scheduler_proc" / "__init__.py").write_text("")
    (tmp_path / "scheduler_proc" / "cache" / "__init__.py").write_text("")
    (tmp_path / "scheduler_proc" / "cache" / "kv_pool.py").write_text(
        '"""See ``scheduler_proc/kv_pool.py``."""\nclass KVPool: ...\n'
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "`scheduler_proc/cache/kv_pool.py` and `kv_pool.py` hold "
        "`scheduler_proc.cache.kv_pool.KVPool`.\n"
        "Gone: `pd_role.py`, `scheduler_proc.pd_role.PdRole`, "
        "`scheduler_proc.cache.kv_pool.Pool`, `scheduler_proc.cache.gone`.\n"
    )
    assert dangling(tmp_path) == [
        "docs/design.md:2: no file is named pd_role.py",
        "docs/design.md:2: scheduler_proc.pd_role.PdRole: "
        "scheduler_proc/ holds no module or package pd_role",
        "docs/design.md:2: scheduler_proc.cache.kv_pool.Pool: "
        "scheduler_proc/cache/kv_pool.py defines no Pool",
        "docs/design.md:2: scheduler_proc.cache.gone: "
        "scheduler_proc/cache/ holds no module or package gone",
        "scheduler_proc/cache/kv_pool.py:1: scheduler_proc/kv_pool.py does not exist",
    ]


# "docs/design.md section 10", "design.md sections 9 and 11", 'docs/design.md, "Structured outputs"'
SECTION_CITATION = re.compile(r"design\.md,?\s+sections?\s+(\d+(?:(?:,\s*|\s+and\s+)\d+)*)")
TITLE_CITATION = re.compile(r'design\.md,\s+"([^"]+)"')


def uncited_sections(root: Path) -> list[str]:
    """Each citation of the design overview by section number or by a quoted title, in the docs,
    docstrings and comments, that names no section or text the overview has."""
    overview = (root / "docs" / "design.md").read_text()
    numbers = set(re.findall(r"^## (\d+)\. ", overview, re.M))
    found = []
    for path, number, text in texts(root):
        where = f"{path.relative_to(root)}:{number}"
        for cited in SECTION_CITATION.findall(text):
            for section in re.findall(r"\d+", cited):
                if section not in numbers:
                    found.append(f"{where}: docs/design.md has no section {section}")
        for title in TITLE_CITATION.findall(text):
            if title not in overview:
                found.append(f'{where}: docs/design.md has no "{title}"')
    return found


def test_every_cited_design_section_exists() -> None:
    problems = uncited_sections(REPO)
    assert not problems, "citations of docs/design.md that lead nowhere:\n" + "\n".join(problems)


def test_the_citation_checker_finds_missing_sections(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "# Design\n\n## 3. When stats travel\n\n## 10. Sampling\n\n**Structured outputs**\n"
    )
    (tmp_path / "README.md").write_text(
        "See docs/design.md section 10, design.md sections 3 and 11, design.md section 16,\n"
        'docs/design.md, "Structured outputs" and docs/design.md, "Gone".\n'
    )
    assert uncited_sections(tmp_path) == [
        "README.md:1: docs/design.md has no section 11",
        "README.md:1: docs/design.md has no section 16",
        'README.md:2: docs/design.md has no "Gone"',
    ]
