"""The package's structure, read from its AST: no import circle among radixengine's modules
(typing-only and function-local imports count: a circle of annotations is still a circle a reader
must untie), no `Any` in mem_cache/ (its handles are typed), and short functions: at most
`MAX_FUNCTION_LINES` lines and cyclomatic complexity `MAX_COMPLEXITY`, files at most
`MAX_FILE_LINES` lines.

Modules resolve this way: `from a.b import c` imports `a.b`
and, when it is a module, `a.b.c`; a package is its `__init__`, so `from pkg import mod` imports
`pkg` too; a module's import of a package it lies in is not counted (Python runs that `__init__`
first anyway, and it is never the module's choice).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "radixengine"
MAX_FUNCTION_LINES, MAX_COMPLEXITY, MAX_FILE_LINES = 40, 15, 500
# Circles still to untie (none now). Each must still exist (a circle that is gone leaves this
# list), and no other may appear.
PENDING_CIRCLES: set[frozenset[str]] = set()
# Subpackages whose functions and files are not held to the limits yet.
LIMITS_PENDING: set[str] = set()


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules `tree` imports anywhere (top level, functions, `if TYPE_CHECKING:`)."""
    top = module.split(".")[0]
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = node.module or ""
            if node.level:
                root = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            names = [root] + [f"{root}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name not in (module, top) and not module.startswith(name + "."):
                found.add(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, for the package at `root` (a folder with `__init__.py`)."""
    files = sorted(root.rglob("*.py"))
    known = {module_name(p, root.parent) for p in files}
    return {
        module_name(p, root.parent): imports_of(
            ast.parse(p.read_text(encoding="utf-8")),
            module_name(p, root.parent),
            p.name == "__init__.py",
            known,
        )
        for p in files
    }


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def complexity(function: ast.AST) -> int:
    """Cyclomatic complexity as structure_check counts it: 1 + branches, loops, handlers, asserts,
    boolean operands past the first, comprehension loops and their conditions, match cases."""
    n = 1
    for node in ast.walk(function):
        if isinstance(
            node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.Assert)
        ):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        elif isinstance(node, ast.match_case):
            n += 1
    return n


def long_functions(path: Path, label: str) -> list[str]:
    """`label:line name: N lines, complexity C` for each function of `path` over a limit."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines, cc = node.end_lineno - node.lineno + 1, complexity(node)
            if lines > MAX_FUNCTION_LINES or cc > MAX_COMPLEXITY:
                found.append(f"{label}:{node.lineno} {node.name}: {lines} lines, complexity {cc}")
    return found


def held_to_limits() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in LIMITS_PENDING]


def test_no_import_circle_in_the_package():
    circles = set(import_circles(import_graph(PACKAGE)))
    new = [" -> ".join(sorted(c)) for c in circles - PENDING_CIRCLES]
    gone = [" -> ".join(sorted(c)) for c in PENDING_CIRCLES - circles]
    assert not new, "import circles (typing-only and function-local imports count):\n" + "\n".join(new)
    assert not gone, "circles untied: take them out of PENDING_CIRCLES:\n" + "\n".join(gone)


def test_no_any_in_mem_cache():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted((PACKAGE / "mem_cache").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
    ]
    assert not found, "Any in mem_cache/ (type the handle instead):\n" + "\n".join(found)


def test_functions_are_short():
    found = [
        line
        for path in held_to_limits()
        for line in long_functions(path, str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines or complexity {MAX_COMPLEXITY}:\n" + "\n".join(found)
    )


def test_files_are_short():
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {n} lines"
        for path in held_to_limits()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    ]
    assert not found, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(found)


# The checks themselves, on small packages written for them ----------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return package


def test_a_circle_of_typing_only_and_function_local_imports_is_found(tmp_path):
    package = write_package(
        tmp_path,
        {
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "b.py": "def f():\n    from . import c\n",
            "c.py": "import pkg.a\n",
            "d.py": "from pkg import a\n",
        },
    )
    assert import_circles(import_graph(package)) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_a_package_init_importing_its_submodules_counts(tmp_path):
    package = write_package(
        tmp_path,
        {
            "sub/__init__.py": "from pkg.sub.x import X\n",
            "sub/x.py": "from pkg.sub import w\nfrom pkg.y import Y\n",
            "y.py": "from pkg.sub import z\n",
        },
    )
    package_graph = import_graph(package)
    assert "pkg.sub" not in package_graph["pkg.sub.x"]  # its own package: not counted
    assert import_circles(package_graph) == [frozenset({"pkg.sub", "pkg.sub.x", "pkg.y"})]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("    return 1\n" * 39, []),
        ("    x = 1\n" * 40, ["f: 41 lines"]),
        ("    if a and b or c:\n        pass\n" * 7, ["f: 15 lines, complexity 22"]),
    ],
)
def test_long_and_complex_functions_are_found(tmp_path, body, expected):
    path = tmp_path / "m.py"
    path.write_text("def f(a, b, c):\n" + body)
    found = [line.split(" ", 1)[1] for line in long_functions(path, "m.py")]
    assert [f for f in found if not any(f.startswith(e) for e in expected)] == []
    assert len(found) == len(expected)
