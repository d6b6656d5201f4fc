"""The scheduler's structure, read from its source: components own their state.

- No mixins: every class of `managers/` has all its methods in one file (its bases from
  `managers/` are defined in the same file), so `self` of one file is never another file's state.
- A component never writes another's attributes: no `self.a.b = ...` in the scheduler or its
  components, and no module writes `scheduler.x = ...`.
- The loop's state (running batch, queue, chunked request, ratio, pending outputs) has one owner."""

from __future__ import annotations

import ast
import pathlib

import radixengine

MANAGERS = pathlib.Path(radixengine.__file__).parent / "managers"
SCHEDULER_FILES = [MANAGERS / "scheduler.py", *sorted((MANAGERS / "scheduler_components").glob("*.py"))]


def _trees(paths: list[pathlib.Path]) -> dict[pathlib.Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in paths}


def _assigned_attributes(tree: ast.AST) -> list[ast.Attribute]:
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets.extend(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
    out: list[ast.Attribute] = []
    for target in targets:
        for node in ast.walk(target):  # tuple targets: a, self.b = ...
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.append(node)
    return out


def _chain_root(node: ast.Attribute) -> tuple[str | None, int]:
    """The name an attribute chain starts from, and its depth (`self.a.b`: ("self", 2))."""
    depth, value = 1, node.value
    while isinstance(value, ast.Attribute):
        depth, value = depth + 1, value.value
    return (value.id if isinstance(value, ast.Name) else None), depth


def test_no_class_in_managers_spreads_over_files():
    trees = _trees(sorted(MANAGERS.rglob("*.py")))
    defined_in = {
        node.name: path
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    offenders = []
    for path, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if cls.name.endswith("Mixin"):
                offenders.append(f"{path.name}: {cls.name} is a mixin")
            for base in cls.bases:
                name = base.id if isinstance(base, ast.Name) else None
                if name in defined_in and defined_in[name] != path:
                    offenders.append(f"{path.name}: {cls.name} extends {name} of {defined_in[name].name}")
    assert not offenders, offenders


def test_components_never_write_each_others_state():
    offenders = []
    for path, tree in _trees(SCHEDULER_FILES).items():
        for attr in _assigned_attributes(tree):
            root, depth = _chain_root(attr)
            if root == "self" and depth > 1:
                offenders.append(f"{path.name}:{attr.lineno} writes {ast.unparse(attr)}")
    package = pathlib.Path(radixengine.__file__).parent
    for path, tree in _trees(sorted(package.rglob("*.py"))).items():
        for attr in _assigned_attributes(tree):
            root, _ = _chain_root(attr)
            if root in {"scheduler", "sched"} or ast.unparse(attr).startswith("self.scheduler."):
                offenders.append(f"{path.name}:{attr.lineno} writes {ast.unparse(attr)}")
    assert not offenders, offenders


def test_the_loops_state_has_one_owner():
    """Each piece of the loop's state is assigned on `self` by exactly one class of the
    scheduler's files (a class lives in one file, above): the running batch by the scheduler,
    the queue by the intake, the chunked request by the admission, the ratio by its tracker."""
    owners: dict[str, set[str]] = {}
    for tree in _trees(SCHEDULER_FILES).values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for attr in _assigned_attributes(cls):
                if _chain_root(attr) == ("self", 1):
                    owners.setdefault(attr.attr, set()).add(cls.name)
    expected = {
        "running_batch": {"Scheduler"},
        "last_batch": {"Scheduler"},
        "cur_batch": {"Scheduler"},
        "result_queue": {"Scheduler"},
        "waiting_queue": {"RequestIntake"},
        "chunked_req": {"PrefillAdmission"},
        "num_departures": {"PrefillAdmission"},
        "pending": {"OutputStreamer"},
        "last_gen_throughput": {"MetricsReporter"},
    }
    assert {name: owners.get(name) for name in expected} == expected
    assert owners["value"] == {"NewTokenRatioTracker"}
