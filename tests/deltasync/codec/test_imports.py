"""How the codec's modules depend on one another: no circle, at module level or inside functions (the
backends are named in one place, deltasync.codec.backend.BACKENDS, and imported by name when first used)."""

import ast
import importlib
import importlib.util

from tests.helpers import REPO

CODEC = REPO / "shared" / "deltasync" / "codec"
PACKAGE = "deltasync.codec"


def imported(tree: ast.AST) -> set[str]:
    """The codec modules a module's code imports, anywhere but under `if TYPE_CHECKING:` (never run)."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            found |= set().union(*(imported(n) for n in node.orelse))
            continue
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found |= {f"{PACKAGE}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
        found |= imported(node)
    return found


def graph() -> dict[str, set[str]]:
    return {f"{PACKAGE}.{p.stem}": imported(ast.parse(p.read_text())) for p in CODEC.glob("*.py")}


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, as the modules along it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for other in sorted(edges.get(module, ())):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[module] = "done"
        path.pop()
        return None

    return next((c for m in sorted(edges) if m not in state and (c := visit(m))), None)


def test_the_codec_imports_no_circle():
    edges = graph()
    assert {f"{PACKAGE}.compact", f"{PACKAGE}.backend"} <= edges[f"{PACKAGE}.patch"]  # (the graph was read)
    assert circle(edges) is None, " -> ".join(circle(edges) or [])


def test_the_circle_finder_finds_one():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_backend_is_named_where_it_is():
    """BACKENDS names a class of the module it names, a subclass of Backend (the CUDA one where Triton is
    installed: CUDA builds of torch bring it)."""
    from deltasync.codec.backend import BACKENDS, Backend

    for module, cls in BACKENDS.values():
        if module == f"{PACKAGE}.gpu" and importlib.util.find_spec("triton") is None:
            continue
        assert issubclass(getattr(importlib.import_module(module), cls), Backend)
