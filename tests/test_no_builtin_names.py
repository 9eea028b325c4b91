"""The core knows contracts, not implementations: no driver or config code compares a component
selection with a built-in component's name (what a component needs, it declares: miles.capabilities)."""

from __future__ import annotations

import ast
from importlib.metadata import distributions
from pathlib import Path

import miles

CORE = Path(miles.__file__).parent
# The code that decides how a run is put together.
CHECKED = [
    CORE / "loop.py",
    CORE / "capabilities.py",
    *sorted((CORE / "driver").glob("*.py")),
    *sorted((CORE / "config").glob("*.py")),
]
# Recipe keys that select a component by name.
SELECTORS = {
    "transport",
    "launcher",
    "backend",
    "generate_fn",
    "fn",
    "reward",
    "filters",
    "buffer",
    "advantage",
    "loss",
    "correction",
    "source",
    "reward_postprocess",
}


def _builtin_names() -> set[str]:
    names: set[str] = set()
    for dist in distributions():
        for ep in dist.entry_points:
            if ep.group.startswith("miles.") and ep.group != "miles.plugins":
                names.add(ep.name)
    return names


def _strings(node: ast.AST, constants: dict[str, ast.AST]) -> list[str]:
    if isinstance(node, ast.Name) and node.id in constants:
        node = constants[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _selects(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in SELECTORS


def _violations(path: Path, builtins: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {
        t.id: stmt.value
        for stmt in tree.body
        if isinstance(stmt, ast.Assign)
        for t in stmt.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if not any(_selects(o) for o in operands):
            continue
        named = {s for o in operands for s in _strings(o, constants)} & builtins
        if named:
            found.append(f"{path.relative_to(CORE)}:{node.lineno}: compares with {sorted(named)}")
    return found


def test_driver_and_config_code_never_compare_a_selection_with_a_builtin_name():
    builtins = _builtin_names()
    assert {"broadcast", "colocated", "embedded", "multi_turn", "nonzero_std"} <= builtins
    found = [v for path in CHECKED for v in _violations(path, builtins)]
    assert found == []


def test_the_check_finds_such_a_comparison(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'NAMES = ("colocated", "disk-delta")\n'
        "def f(config):\n"
        '    return config.transport == "broadcast" or config.transport in NAMES\n'
    )
    found = _violations_at(bad)
    assert len(found) == 2


def _violations_at(path: Path) -> list[str]:
    global CORE
    saved, CORE = CORE, path.parent
    try:
        return _violations(path, _builtin_names())
    finally:
        CORE = saved
