"""The import graph of the library (``p2pdiloco``) and the apps (``node``, ``bootstrap``): no
cycles, and the library imports an app only from its one command-line entry module
(``p2pdiloco.cli``). Read from the source (``ast``), imports inside functions included,
annotations-only imports (``if TYPE_CHECKING:``) excluded. And the size of their rooms: no
module over ``MAX_MODULE_LINES`` lines, no function over ``MAX_FUNCTION_LINES``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2pdiloco", "node", "bootstrap")
ENTRY = "p2pdiloco.cli"
MAX_MODULE_LINES = 400  # lines of one module of the library or the apps, docstrings included
MAX_FUNCTION_LINES = 60  # lines of one function or method, from its first decorator, docstring included


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules that module ``name`` (file ``path``) imports."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:  # "from pkg import mod" imports the module pkg.mod
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(ast.parse(path.read_text()))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_walker_sees_imports_inside_functions_and_not_annotation_only_ones():
    g = graph()
    assert "node.main" in g[ENTRY]  # cli imports the node's app inside a function
    assert "p2pdiloco.model" not in g["p2pdiloco.factory"]  # only under TYPE_CHECKING
    assert "p2pdiloco.factory" in g["p2pdiloco.model"]  # inside build_model
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_library_imports_apps_only_from_its_entry_module():
    g = graph()
    wrong = sorted((m, d) for m, deps in g.items() if m.startswith("p2pdiloco") and m != ENTRY
                   for d in deps if not d.startswith("p2pdiloco"))
    assert wrong == []


def test_modules_and_functions_stay_small():
    """Every module of the library and the apps is a room with one job: at most
    ``MAX_MODULE_LINES`` lines, and none of its functions (methods and nested ones included)
    over ``MAX_FUNCTION_LINES`` lines, counted from the first decorator to the last line."""
    long_modules, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} (line {node.lineno}): {n} lines")
    assert long_modules == [] and long_functions == [], (long_modules, long_functions)


def test_settings_are_checked_without_torch():
    """``node run`` and the demo check a node's settings before importing torch (p2pdiloco.cli),
    so a bad setting is answered in well under a second: the configuration's modules import
    neither torch nor hivemind."""
    code = ("import sys; from p2pdiloco.config import load_config; cfg = load_config(env={}); "
            "print(sorted(m for m in ('torch', 'hivemind', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out


def test_bench_is_a_package_run_from_the_root():
    """bench/ runs as ``python -m bench.NAME`` (or ``python -m bench run NAME``): no benchmark
    edits ``sys.path`` or imports the tests, and the runner lists every benchmark module."""
    from bench.__main__ import HELPERS, benchmarks
    for f in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                raise AssertionError(f"{f.name} edits sys.path")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.split(".")[0] == "tests" for n in names), f"{f.name} imports test code"
    assert set(benchmarks()) == {f.stem for f in (ROOT / "bench").glob("*.py")} - HELPERS
