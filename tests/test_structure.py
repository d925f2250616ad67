"""Structure rules the code review holds the package to, checked so that they stay true: short
entry points and Decoder class, no upward import from the model layer into the decoder, no import
circle anywhere in ddtree/ (lazy imports inside functions included), and results/ holding exactly
what the docs cite, indexed."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _function_lines(path: str, name: str) -> int:
    tree = ast.parse((REPO / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path,name", [("ddtree/ops/attention.py", "tree_attention"), ("ddtree/app/cli.py", "run_generate"),
                                       ("ddtree/app/bench.py", "run_bench")])
def test_entry_points_are_short(path, name):
    assert _function_lines(path, name) <= 90, f"{path}:{name} is over 90 lines: extract helpers"


def test_decoder_class_is_short():
    tree = ast.parse((REPO / "ddtree/decode/decoder.py").read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Decoder")
    n = node.end_lineno - node.lineno + 1
    assert n <= 350, f"the Decoder class is {n} lines (at most 350): move a concept to its own module"


def _imports(path: Path) -> set[str]:
    """Every ddtree module a file imports, at any depth of its code (lazy imports included)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("ddtree"):
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("ddtree"))
    return out


def test_model_and_ops_do_not_import_the_decoder():
    offenders = [f"{p.relative_to(REPO)}: {m}" for sub in ("model", "ops") for p in (REPO / "ddtree" / sub).rglob("*.py")
                 for m in _imports(p) if m.startswith("ddtree.decode")]
    assert not offenders, offenders


def _module_graph() -> dict[str, set[str]]:
    """ddtree's modules -> the ddtree modules each imports, at any depth of its code: an import
    inside a function is a dependency of the design all the same (it only defers the cost). A
    package's __init__ is the package's own name; `from ddtree.app import setup` reaches the module
    ddtree.app.setup, `from ddtree.app.setup import X` the same module."""
    root = REPO / "ddtree"
    names = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:  # relative: from the package, up level - 1
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - n.level + 1] + ([base] if base else []))
                for a in n.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in names else base)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_ddtree():
    graph = _module_graph()
    assert len(graph) > 50 and "ddtree.app.setup" in graph["ddtree.app.cli"] | graph["ddtree.app.chat"]
    circles = [" <-> ".join(c) + ": " + "; ".join(f"{a} imports {', '.join(sorted(graph[a] & set(c)))}" for a in c)
               for c in _cycles(graph)]
    assert not circles, "import circles (move what both sides share into a module both import downward): " \
        + " | ".join(circles)


def test_the_circle_finder_finds_circles():
    """The check above on small graphs, so that it cannot pass by finding nothing."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    assert sorted(_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}})) == [["a", "b"], ["c", "d"]]


def test_gdn_does_not_import_fla():
    assert not any(m.startswith("ddtree.ops.fla") for m in _imports(REPO / "ddtree/ops/gdn.py")), \
        "gdn.py imports fla while fla.py imports gdn: the choice between them lives in fla.chain_final"


def _cited() -> set[str]:
    """results/ names the top-level README and docs/*.md cite ({a,b} and * patterns expanded)."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    files = [p.name for p in (REPO / "results").iterdir() if p.name != "README.md"]
    cited = set()
    for ref in re.findall(r"results/([A-Za-z0-9_.*{},-]+)", text):
        for pat in _braces(ref.rstrip(".,")):
            cited.update(fnmatch.filter(files, pat))
    return cited


def _braces(ref: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in _braces(ref[:m.start()] + alt + ref[m.end():])]


def test_results_hold_what_the_docs_cite_and_are_indexed():
    files = {p.name for p in (REPO / "results").iterdir() if p.name != "README.md"}
    index = (REPO / "results" / "README.md").read_text()
    rows = {name for line in index.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])}
    assert files <= _cited(), f"in results/ but cited by no doc: {sorted(files - _cited())}"
    assert files <= rows, f"in results/ but not in results/README.md's index: {sorted(files - rows)}"
    assert rows <= files, f"indexed in results/README.md but not in results/: {sorted(rows - files)}"
