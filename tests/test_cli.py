"""The ``miles`` command line: lazy commands, one-line errors, and each command's output."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from plugin_fixtures import FIXTURE_PLUGINS

from miles.cli import LAZY_COMMANDS, cli

RECIPES = Path(__file__).parent / "data" / "recipes"
TINY = str(RECIPES / "tiny.yaml")
MILES = Path(sys.executable).parent / "miles"
HEAVY = ("torch", "transformers", "numpy", "fastapi")

COMPONENTS = """
class Backend: ...
class Transport: ...
class Buffer: ...
class Source: ...
class Launcher: ...
async def rollout(ctx, prompts): return []
async def generate(ctx, sample): return sample
def keep(group): return True
def advantage(groups): return []
"""
ALL_BY_PATH = [
    "backend=cli_components:Backend",
    "transport=cli_components:Transport",
    "rollout.fn=cli_components:rollout",
    "rollout.generate_fn=cli_components:generate",
    "rollout.reward=length_penalty",
    "rollout.filters=[cli_components:keep]",
    "rollout.buffer=cli_components:Buffer",
    "algorithm.advantage=cli_components:advantage",
    "algorithm.loss=cli_components:advantage",
    "algorithm.correction=null",
    "data.source=cli_components:Source",
    "engine.launcher=cli_components:Launcher",
]


def _miles(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MILES), *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def _private_cache(tmp_path: Path) -> dict[str, str]:
    """tmp_path on PYTHONPATH plus a private XDG_CACHE_HOME: stevedore caches entry points per
    sys.path there, so a throw-away path would otherwise leave a cache file in ~/.cache on every run.
    What PYTHONPATH holds already (the fixture plugins, when a test asks for them) stays on it."""
    inherited = os.environ.get("PYTHONPATH")
    pythonpath = os.pathsep.join([str(tmp_path), *filter(None, [inherited])])
    return {"PYTHONPATH": pythonpath, "XDG_CACHE_HOME": str(tmp_path / "cache")}


def _invoke(*args: str, **env: str):
    return CliRunner().invoke(cli, list(args), env=env or None)


def _error_lines(stderr: str) -> list[str]:
    """stderr without warnings (the broken fixture plugin warns in the tests that install it)."""
    return [line for line in stderr.splitlines() if not line.startswith("warning: ")]


# --------------------------------------------------------------------------------- help


def test_help_imports_no_heavy_library_and_is_fast() -> None:
    code = (
        "import sys, time\n"
        "t0 = time.perf_counter()\n"
        "sys.argv = ['miles', '--help']\n"
        "from miles.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "lazy = sorted(m for m in sys.modules if m.startswith('miles.cli.') and m != 'miles.cli._common')\n"
        "print(heavy, lazy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr.strip() == "[] []"
    assert "run " in done.stdout and "plugins " in done.stdout
    start = time.perf_counter()
    result = _miles("--help")
    wall = time.perf_counter() - start
    assert result.returncode == 0
    print(f"`miles --help` took {wall:.3f}s")
    assert wall < 5.0  # measured ~0.15s; generous for a loaded 2-core CI machine


def test_every_command_has_working_help() -> None:
    for name in LAZY_COMMANDS:
        result = _invoke(name, "--help")
        assert result.exit_code == 0, (name, result.output)
        assert result.output.startswith(f"Usage: cli {name}")
    for sub in ("show", "validate", "schema"):
        assert _invoke("config", sub, "--help").exit_code == 0


def test_plugin_commands_come_from_their_entry_points() -> None:
    """``miles serve`` and ``miles check-family`` are miles-envs's (``miles.commands``), not the core's."""
    from miles.cli import plugin_commands

    found = plugin_commands()
    assert found["serve"] == "miles_envs.cli.serve:serve"
    assert found["check-family"] == "miles_envs.cli.families:check_family"
    assert not set(found) & set(LAZY_COMMANDS)
    for name in ("serve", "check-family"):
        result = _invoke(name, "--help")
        assert result.exit_code == 0, (name, result.output)
        assert result.output.startswith(f"Usage: cli {name}")


def test_a_broken_plugin_command_is_listed_not_fatal() -> None:
    from miles.cli import LazyGroup

    class Group(LazyGroup):
        def _plugin_commands(self) -> dict[str, str]:
            return {"broken": "no_such_module_for_miles_tests:command"}

    @click.group(cls=Group)
    def group() -> None:
        """A group with one broken plugin command."""

    runner = CliRunner()
    listed = runner.invoke(group, ["--help"])
    assert listed.exit_code == 0, listed.output
    assert "broken" in listed.output and "broken plugin command" in listed.output
    selected = runner.invoke(group, ["broken"])
    assert selected.exit_code != 0 and "not available" in selected.output


def test_listed_help_matches_each_command() -> None:
    ctx = click.Context(cli)
    for name, (_, short_help) in LAZY_COMMANDS.items():
        assert cli.get_command(ctx, name).get_short_help_str(limit=1000) == short_help, name


# ------------------------------------------------------------------------------- errors


def test_a_bad_recipe_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: m\ndata:\n  path: d\nrollout:\n  temprature: 0.5\n")
    result = _miles("config", "validate", str(bad))
    assert result.returncode == 1
    assert _error_lines(result.stderr) == [
        f"Error: recipe {bad}: unknown key 'rollout.temprature' ({bad}:6); did you mean 'rollout.temperature'?"
    ]
    assert result.stdout == ""


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    for args in (["-v", "config", "validate", str(bad)], ["config", "validate", str(bad), "-v"]):
        result = _miles(*args)
        assert result.returncode == 1
        assert "Traceback (most recent call last)" in result.stderr
        assert "miles.errors.ConfigError" in result.stderr


def test_usage_errors_exit_2() -> None:
    result = _invoke("run", "--resume", "--overwrite")
    assert result.exit_code == 2
    assert "--resume and --overwrite exclude each other" in result.output


def test_unknown_command_suggests_the_closest() -> None:
    result = _invoke("plugin")
    assert result.exit_code == 2
    assert (
        "No such command 'plugin'. Did you mean 'plugins'? Commands: check-family, config, engine, models, plugins, recipes, replay, report, "
        "run, serve." in result.output
    )


# ------------------------------------------------------------------------------- config


@pytest.mark.usefixtures("fixture_plugins")  # the example plugin's `example` section
def test_config_show_prints_the_resolved_recipe() -> None:
    result = _invoke(
        "config", "show", TINY, "--set", "rollout.temperature=0.25", "--set", "example.target_length=3"
    )
    assert result.exit_code == 0, result.output
    assert "  temperature: 0.25\n" in result.stdout
    assert "example:\n  target_length: 3\n" in result.stdout
    assert result.stdout.startswith(f"recipe: {Path(TINY).resolve()}\n")


@pytest.mark.usefixtures("fixture_plugins")  # rollout.reward=length_penalty
def test_config_validate_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every key by import path is found without --check (the empty classes above are not real
    # components: --check builds them, and `miles run` would refuse them).
    (tmp_path / "cli_components.py").write_text(COMPONENTS)
    args = [arg for override in ALL_BY_PATH for arg in ("--set", override)]
    result = _miles("config", "validate", TINY, *args, env=_private_cache(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ok: {TINY}\n"
    (tmp_path / "cli_reward.py").write_text("def score(sample):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)  # import paths resolve from the cwd, which is then put on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    result = _invoke("config", "validate", TINY, "--check", "--set", "rollout.reward=cli_reward:score")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"ok: {TINY}\n"


def _bad_data(tmp_path: Path) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": oops}\n')
    return str(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (lambda tmp: f"data.path={tmp / 'missing.jsonl'}", "data file '{tmp}/missing.jsonl' does not exist"),
        (lambda tmp: f"data.path={_bad_data(tmp)}", "data file '{tmp}/bad.jsonl', line 2: invalid JSON"),
        (lambda tmp: "rollout.reward=math:pi", "reward 'math:pi' must be callable, got float"),
        (lambda tmp: "algorithm.loss=builtins:print", "loss 'builtins:print' takes (*args"),
    ],
    ids=["missing-data-file", "bad-data-line", "non-callable-reward", "loss-of-the-wrong-shape"],
)
def test_config_validate_check_refuses_what_run_refuses(tmp_path: Path, override, expected: str) -> None:
    """`validate --check` runs `miles run`'s own pre-flight (miles.driver.preflight)."""
    result = _invoke("config", "validate", TINY, "--check", "--set", override(tmp_path))
    assert result.exit_code == 1, result.output
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("Error: "), result.stderr
    assert expected.format(tmp=tmp_path) in errors[0]


def test_config_validate_check_refuses_an_engine_port_in_use() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _invoke("config", "validate", TINY, "--check", "--set", f"engine.port={port}")
    assert result.exit_code == 1, result.output
    assert _error_lines(result.stderr) == [
        f"Error: engine.port: engine 0 would listen on 127.0.0.1:{port}, which is already in use; "
        "choose another engine.port or leave it unset to pick free ports"
    ]


@pytest.mark.usefixtures("fixture_plugins")
def test_config_schema_is_json_with_plugin_sections() -> None:
    result = _invoke("config", "schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert {"rollout", "example"} <= set(schema["properties"])


# ------------------------------------------------------------------------ plugins, recipes


@pytest.mark.usefixtures("fixture_plugins")
def test_plugins_json_and_table() -> None:
    result = _invoke("plugins", "--json")
    assert result.exit_code == 0
    rows = {row["distribution"]: row for row in json.loads(result.stdout)}
    assert rows["miles-example-plugin"]["status"] == "active"
    assert rows["miles-example-plugin"]["provides"] == [
        "hooks:example",
        "engine:echo",
        "loss:reinforce",
        "reward:length_penalty",
    ]
    assert rows["miles-broken-plugin"]["status"].startswith(
        "broken: hooks 'broken' failed to import: ModuleNotFoundError"
    )
    table = _invoke("plugins")
    assert table.exit_code == 0
    assert "miles-example-plugin" in table.stdout and "reward:length_penalty" in table.stdout
    assert "miles_nonexistent_dependency" in table.stdout.replace("\n", "").replace(" ", "")


@pytest.mark.usefixtures("fixture_plugins")
def test_plugins_lists_a_component_that_cannot_import_as_broken(tmp_path: Path) -> None:
    """Hooks that load are not enough: a reward whose module fails to import makes the plugin broken."""
    (tmp_path / "cli_bad_reward.py").write_text("import cli_missing_dependency\n")
    (tmp_path / "cli_fine_hooks.py").write_text("")
    info = tmp_path / "miles_cli_half_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-cli-half-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[miles.plugins]\nhalf = cli_fine_hooks\n\n[miles.rewards]\nhalf_reward = cli_bad_reward:score\n"
    )
    result = _miles("plugins", env={**_private_cache(tmp_path), "COLUMNS": "400"})  # one line per row
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("miles-cli-half-broken"))
    assert row.split()[:3] == ["miles-cli-half-broken", "1.0", "hooks:half"]
    assert row.rstrip().endswith(
        "broken: reward 'half_reward' failed to import: ModuleNotFoundError: No module named 'cli_missing_dependency'"
    )
    assert "distributions have problems" in result.stderr  # the listing warns, not only marks
    quick = _miles("plugins", "--json", "--no-check", env=_private_cache(tmp_path))
    rows = {row["distribution"]: row for row in json.loads(quick.stdout)}
    assert rows["miles-cli-half-broken"]["status"] == "components not checked"
    assert rows["miles-example-plugin"]["status"] == "components not checked"


def test_a_fresh_environment_has_no_fixture_plugins() -> None:
    """The fixture plugins of tests/plugins are installed only for the tests that ask for them
    (``fixture_plugins``): the workspace's environment, which every developer's ``uv run miles``
    uses, holds neither, so its commands print no plugin warning and no ``example`` section."""
    for dist in FIXTURE_PLUGINS:
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(dist)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    listing = subprocess.run([str(MILES), "plugins", "--json"], capture_output=True, text=True, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "warning" not in listing.stderr.lower() and "broken" not in listing.stderr, listing.stderr
    rows = {row["distribution"]: row for row in json.loads(listing.stdout)}
    assert "miles-core" in rows
    assert not set(FIXTURE_PLUGINS) & set(rows)
    # (`plugins` in its table form reads the same discovery as --json above: not run again)
    for args in (["config", "show", "default"], ["run", "default", "--dry-run"]):
        result = subprocess.run([str(MILES), *args], capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr
        assert "warning" not in result.stderr.lower() and "broken" not in result.stderr, result.stderr
        assert "example" not in result.stdout and "broken" not in result.stdout, result.stdout


@pytest.mark.usefixtures("fixture_plugins")
def test_the_fixture_plugins_reach_the_miles_command() -> None:
    """The other half: with the fixture, the `miles` console script discovers them through entry points."""
    result = _miles("config", "show", "default", "--set", "example.target_length=5")
    assert result.returncode == 0, result.stderr
    assert "\nexample:\n  target_length: 5\n" in result.stdout
    assert "warning: plugin 'broken' from miles-broken-plugin 0.0.1 is broken" in result.stderr


def test_recipes_lists_builtin_and_path_recipes() -> None:
    result = _invoke("recipes", MILES_RECIPE_PATH=str(RECIPES))
    assert result.exit_code == 0
    assert "default" in result.stdout and "built-in" in result.stdout
    assert "tiny" in result.stdout and "Tiny test recipe" in result.stdout


# ----------------------------------------------------------------------------------- run


def test_run_dry_run_validates_and_prints_without_training(tmp_path: Path) -> None:
    # --dry-run runs the run's own pre-flight (components are built), so these are real ones.
    (tmp_path / "cli_reward.py").write_text("def score(sample):\n    return 1.0\n")
    overrides = ["rollout.reward=cli_reward:score"]
    code = (
        "import sys\n"
        "from miles.cli import main\n"
        f"sys.argv = ['miles', 'run', {TINY!r}, '--dry-run', *{[a for o in overrides for a in ('--set', o)]!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print('LOOP IMPORTED' if 'miles.loop' in sys.modules else 'loop not imported', code, file=sys.stderr)\n"
    )
    env = {**os.environ, **_private_cache(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stderr.strip().endswith("loop not imported 0"), result.stderr
    assert result.stdout.startswith(f"recipe: {Path(TINY).resolve()}\n")
    assert "reward: cli_reward:score" in result.stdout


@pytest.mark.usefixtures("fixture_plugins")
def test_run_selecting_a_broken_plugin_fails_before_training() -> None:
    result = _miles("run", TINY, "--set", "rollout.reward=broken_reward")
    assert result.returncode == 1
    errors = _error_lines(result.stderr)
    assert errors[0].startswith("Error: ")
    assert (
        "rollout.reward: reward 'broken_reward' from miles-broken-plugin 0.0.1 failed to import "
        "(entry point miles.rewards: broken_reward = miles_broken_plugin.reward:score): "
        "ModuleNotFoundError: No module named 'miles_nonexistent_dependency'"
    ) in result.stderr
    assert "Traceback" not in result.stderr
