"""The READMEs and docs/ point only at what exists: relative links and their anchors, `make` targets,
`python -m` modules, `python FILE.py` paths, `deltasync` subcommands, the library names their Python imports,
and each Space README's table of variables and secrets matches its app's settings class."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "spaces").rglob("README.md")],
    key=str,
)
SPACES = ("inference", "env", "dashboard")
# Read by a library inside the app, not by its settings class; the Space README's table lists them too.
# Variables the library reads in the app's process (huggingface_hub's token; the LoRA resolver's cache).
LIBRARY_VARIABLES = {
    "inference": {"HF_TOKEN", "DELTASYNC_LORA_CACHE", "DELTASYNC_LORA_KEEP"},
    "env": set(),
    "dashboard": {"HF_TOKEN"},
}
MAX_README_LINES = 200

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


def code_snippets(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, and ("inline", code) of every inline code span outside them."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return blocks + [("inline", m.group(1)) for m in INLINE.finditer(prose)]


def shell_lines(text: str) -> list[str]:
    """Command lines: each line of a shell (or unlabelled) block, and each inline code span."""
    lines = []
    for lang, code in code_snippets(text):
        if lang in ("", "bash", "sh", "shell", "console", "inline"):
            lines += [line.strip().removeprefix("$ ") for line in code.splitlines()]
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_relative_links_point_at_files_and_headings(doc: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def module_exists(name: str) -> bool:
    """A module of the repository (as a file, so nothing is imported) or an installed one."""
    base = REPO / Path(*name.split("."))
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return True
    sys.path.insert(0, str(REPO))
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    finally:
        sys.path.remove(str(REPO))


def is_subcommand(name: str) -> bool:
    """Whether `deltasync NAME --help` is the help of a subcommand (argparse exits 0) or an error (2)."""
    from deltasync.cli import build_parser

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args([name, "--help"])
        except SystemExit as e:
            return e.code == 0
    return False


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_commands_name_what_exists(doc: Path):
    targets = make_targets()
    wrong = []
    for line in shell_lines(doc.read_text()):
        for target in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", line):
            if target not in targets:
                wrong.append(f"make {target}: no such target in the Makefile")
        for module in re.findall(r"python3? -m ([\w.]+)", line):
            if not module.split(".")[-1].isupper() and not module_exists(module):  # bench.NAME: a placeholder
                wrong.append(f"python -m {module}: no such module")
        for script in re.findall(r"python3? ([\w./-]+/[\w.-]+\.py)\b", line):
            if not (REPO / script).is_file():
                wrong.append(f"python {script}: no such file")
        for command in re.findall(r"(?:^|[\s;&(])deltasync ([a-z][\w-]*)", line):
            if not is_subcommand(command):
                wrong.append(f"deltasync {command}: no such subcommand")
    assert not wrong, f"{doc.relative_to(REPO)}: {wrong}"


TOP_FOLDERS = "shared|trainer|spaces|tests|bench|docs|examples"
REPO_PATH = re.compile(rf"(?<![\w/.-])(?:\.\./)*((?:{TOP_FOLDERS})/[\w./-]*)")


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_repository_paths_exist(doc: Path):
    """Paths into the repository named in code (`shared/deltasync/storage/`, `tests/spaces/...`)."""
    missing = []
    for _, code in code_snippets(doc.read_text()):
        for path in REPO_PATH.findall(code):
            if not (REPO / path.rstrip(".")).exists():
                missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def module_file(module: str) -> Path | None:
    """The source of a library module, found without importing anything."""
    base = REPO / "shared" / Path(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def top_level_names(module: str) -> set[str]:
    """Names a library module defines or imports at its top level, read from its source (for a module that
    resolves names lazily, with a module-level __getattr__: imported, its attributes)."""
    tree = ast.parse(module_file(module).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            if node.name == "__getattr__":
                return set(dir(importlib.import_module(module)))
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_python_examples_import_what_the_library_has(doc: Path):
    missing = []
    for lang, code in code_snippets(doc.read_text()):
        if lang != "python":
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deltasync":
                if module_file(node.module) is None:
                    missing.append(node.module)
                    continue
                names = top_level_names(node.module)
                missing += [f"{node.module}.{a.name}" for a in node.names if a.name not in names]
    assert not missing, f"{doc.relative_to(REPO)} imports what does not exist: {missing}"


DOTTED = re.compile(r"\bdeltasync(?:\.[A-Za-z_]\w*)+")


def resolves(dotted: str) -> bool:
    """`deltasync.sub.module[.name]`: the longest module prefix exists and defines the next name, if any."""
    parts = dotted.split(".")
    i = max(n for n in range(1, len(parts) + 1) if module_file(".".join(parts[:n])))
    return i == len(parts) or parts[i] in top_level_names(".".join(parts[:i]))


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_library_names_resolve(doc: Path):
    """Modules and names of the library named in code (`deltasync.sync.publisher`, `deltasync.trl.X`)."""
    unknown = [name for _, code in code_snippets(doc.read_text()) for name in DOTTED.findall(code)]
    unknown = [name for name in unknown if not resolves(name)]
    assert not unknown, f"{doc.relative_to(REPO)} names what the library does not have: {unknown}"


def settings_fields(app: str) -> set[str]:
    """The environment variables of the app's `Settings` (pydantic-settings: field name in upper case)."""
    tree = ast.parse((REPO / "spaces" / app / "app.py").read_text())
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    source = ast.unparse(cls)
    assert "env_prefix" not in source and "alias" not in source, "variables not named as fields: update this"
    return {
        n.target.id.upper()
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id != "model_config"
    }


def table_variables(readme: Path) -> set[str]:
    """The names in the first column of the README's one table whose header starts with `| name |`."""
    text = FENCE.sub("", readme.read_text())
    tables = re.findall(r"^\| name \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M)
    assert len(tables) == 1, f"{readme.relative_to(REPO)}: {len(tables)} variable tables, expected one"
    first_cells = [row.split("|")[1] for row in tables[0].splitlines()]
    return {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}


@pytest.mark.parametrize("app", SPACES)
def test_space_readme_lists_exactly_its_settings(app: str):
    listed = table_variables(REPO / "spaces" / app / "README.md")
    expected = settings_fields(app) | LIBRARY_VARIABLES[app]
    assert listed == expected, f"missing {sorted(expected - listed)}, unknown {sorted(listed - expected)}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md: {lines} lines, at most {MAX_README_LINES} (details: docs/)"
