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


# ------------------------------------------------------------------ the agentic stack is a plugin

# Plugin distributions of the workspace: the core never imports one (it finds them by entry point).
PLUGIN_PACKAGES = {"miles_envs", "miles_fsdp", "miles_megatron", "miles_transports", "miles_diffusion"}
# What only the agentic package (miles-envs) knows; none of it may be a name in the core's code.
AGENTIC_IDENTIFIERS = ("agentic", "session_server", "session_store", "model_family", "famil")
# The one table that names what lives outside the bare install (what to pip install for a name).
HINTS = CORE / "_plugins" / "hints.py"


def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code binds or reads: modules imported, attributes, functions, classes, arguments."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(part for m in modules for part in m.split("."))
            found.update(a.asname or a.name for a in node.names)
    return found


def _agentic_names_in(path: Path, envs_names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(CORE)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.partition(".")[0] in PLUGIN_PACKAGES:
                    problems.append(f"{where}:{node.lineno}: imports {module}")
    # (socket's address family and Prometheus's metric families are not model families.)
    allowed = {"family", "GaugeMetricFamily"}
    for name in sorted(_identifiers(tree) - allowed):
        if any(word in name.lower() for word in AGENTIC_IDENTIFIERS):
            problems.append(f"{where}: names {name!r}")
    if path != HINTS:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            text = node.value
            # Not even the kinds miles-envs adds (agent, toolset, session_matcher): it declares them.
            if text in envs_names or text.startswith("miles_envs"):
                problems.append(f"{where}:{node.lineno}: names {text!r}, which miles-envs provides")
    return problems


def _envs_names() -> set[str]:
    from importlib.metadata import distribution

    return {ep.name for ep in distribution("miles-envs").entry_points if ep.group.startswith("miles.")}


def test_core_keeps_no_agentic_names_and_imports_no_plugin() -> None:
    envs = _envs_names()
    assert {"multi_turn", "agentic", "tool_agent", "calculator", "strict"} <= envs
    found = [p for path in _core_files() for p in _agentic_names_in(path, envs)]
    assert found == []
    for package in ("sessions", "session_server", "families"):
        assert not (CORE / package).exists(), package
    from miles.config.schema import MilesConfig

    assert "agentic" not in MilesConfig.model_fields  # the section is miles-envs's (miles_config_sections)


def test_everything_agentic_is_registered_by_miles_envs() -> None:
    """The agentic components, hooks and commands are miles-envs's entry points, pointing into it."""
    from importlib.metadata import distribution

    core = {(ep.group, ep.name) for ep in distribution("miles-core").entry_points}
    envs = [ep for ep in distribution("miles-envs").entry_points if ep.group.startswith("miles.")]
    assert all(ep.value.startswith("miles_envs.") for ep in envs), envs
    assert not core & {(ep.group, ep.name) for ep in envs}
    groups = {ep.group for ep in envs}
    assert {"miles.plugins", "miles.commands", "miles.generates", "miles.session_matchers"} <= groups


def test_the_agentic_check_finds_a_name_that_crept_back(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from miles_envs.sessions import SessionStore\n"
        "def f(config):\n"
        "    return config.agentic, 'multi_turn'\n"
    )
    global CORE
    saved, CORE = CORE, tmp_path
    try:
        found = _agentic_names_in(bad, _envs_names())
    finally:
        CORE = saved
    assert any("imports miles_envs.sessions" in f for f in found)
    assert any("'agentic'" in f for f in found) and any("'multi_turn'" in f for f in found)


# ------------------------------------------------------------------ diffusion is a plugin too

# What only miles-diffusion knows (image trajectories, denoising): never a name in the core's code.
DIFFUSION_IDENTIFIERS = ("diffusion", "denois", "flow_grpo", "image_reward")


def _diffusion_names() -> set[str]:
    from importlib.metadata import distribution

    return {ep.name for ep in distribution("miles-diffusion").entry_points if ep.group.startswith("miles.")}


def _diffusion_names_in(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(CORE)
    problems = [
        f"{where}: names {name!r}"
        for name in sorted(_identifiers(tree))
        if any(word in name.lower() for word in DIFFUSION_IDENTIFIERS)
    ]
    if path != HINTS:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text in names or text.startswith(("miles_diffusion", "miles-diffusion")):
                    problems.append(f"{where}:{node.lineno}: names {text!r}, which miles-diffusion provides")
    return problems


def test_core_keeps_no_diffusion_names() -> None:
    """The core's generic contracts (Sample.payload, EngineCapabilities.tokens, the miles.recipes and
    miles.models groups) carry diffusion; not one of its names is in the core's code."""
    names = _diffusion_names()
    assert {"diffusion", "flow_grpo", "diffusion_grpo", "brightness", "tiny-flow-unet"} <= names
    found = [p for path in _core_files() for p in _diffusion_names_in(path, names)]
    assert found == []
    from miles.config.schema import MilesConfig

    assert "diffusion" not in MilesConfig.model_fields  # the section is miles-diffusion's


def test_everything_diffusion_is_registered_by_miles_diffusion() -> None:
    from importlib.metadata import distribution

    core = {(ep.group, ep.name) for ep in distribution("miles-core").entry_points}
    ours = [ep for ep in distribution("miles-diffusion").entry_points if ep.group.startswith("miles.")]
    assert all(ep.value.startswith("miles_diffusion.") for ep in ours), ours
    assert not core & {(ep.group, ep.name) for ep in ours}
    groups = {ep.group for ep in ours}
    assert {"miles.plugins", "miles.engines", "miles.backends", "miles.recipes", "miles.models"} <= groups


def test_the_diffusion_check_finds_a_name_that_crept_in(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(denoising_steps):\n    return 'flow_grpo'\n")
    global CORE
    saved, CORE = CORE, tmp_path
    try:
        found = _diffusion_names_in(bad, _diffusion_names())
    finally:
        CORE = saved
    assert any("'denoising_steps'" in f for f in found) and any("'flow_grpo'" in f for f in found)
