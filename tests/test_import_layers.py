"""Imports run downward, with the data (DESIGN.md "Layout"): nothing below `managers` imports
`managers` or what sits on it (the engine, the entrypoints), typing-only imports included, and
`mem_cache` imports nothing of radixengine. An AST walk over the package, so a new upward import
fails here before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "radixengine"
ABOVE_THE_WORKER = {"managers", "engine", "entrypoints", "launch_server"}
BELOW_MANAGERS = {
    "mem_cache", "constrained", "sampling", "layers", "models", "model_loader", "model_executor", "utils",
    "function_call", "parser", "distributed",
}  # fmt: skip


def imported_subpackages(path: Path) -> set[str]:
    """The radixengine subpackages (or top-level modules) a file imports, at any depth of the
    file (inside functions and `if TYPE_CHECKING:` too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("radixengine.")}
    return out


def files_of(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


def test_nothing_below_managers_imports_upward():
    upward = []
    for sub in sorted(BELOW_MANAGERS):
        for path in files_of(sub):
            for target in imported_subpackages(path) & ABOVE_THE_WORKER:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports radixengine.{target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_mem_cache_imports_nothing_of_radixengine():
    found = [
        f"{p.relative_to(PACKAGE.parent)} imports radixengine.{t}"
        for p in files_of("mem_cache")
        for t in imported_subpackages(p) - {"mem_cache"}
    ]
    assert not found, "\n".join(found)


def test_the_walk_sees_typing_only_imports(tmp_path):
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixengine.managers.x import Y\n"
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imported_subpackages(path) == {"managers"}


def test_distributed_imports_only_utils():
    """The collectives sit under the layers: radixengine.distributed imports only utils."""
    found = {
        f"{path.relative_to(PACKAGE.parent)} imports radixengine.{target}"
        for path in files_of("distributed")
        for target in imported_subpackages(path) - {"distributed", "utils"}
    }
    assert not found, "\n".join(sorted(found))
