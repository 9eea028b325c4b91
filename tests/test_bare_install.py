"""A bare ``pip install miles-core`` (no extras: no torch, no backend, no transport).

A real install, not a simulation: a fresh virtual environment gets miles-core's own
dependencies at the versions of ``uv.lock`` and miles-core built from this checkout,
offline from uv's cache (which ``uv sync`` filled). Every command that needs something
missing must end in one ``Error:`` line saying what to install, with exit code 1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from miles._plugins import hints

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "packages" / "miles-core"

USER_RECIPE = """\
model:
  path: builtin:tiny-qwen3
data:
  path: builtin:arith
"""
USER_MODULE = "class Backend: ...\nclass Transport: ...\n"


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``miles`` console script of a venv holding miles-core and nothing else."""
    if shutil.which("uv") is None:
        pytest.skip("needs uv to build the bare environment")
    root = tmp_path_factory.mktemp("bare")
    # uv sync of miles-core alone (no extras, no dev group) from uv.lock, offline: the wheels come from
    # the cache the workspace's own sync filled (``uv pip install --offline`` would also need the
    # registry's index pages cached, which a locked sync never fetches). Not editable: a wheel built
    # from this checkout, as pip would install it from PyPI.
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(root / "venv"))
    result = subprocess.run(
        ["uv", "sync", "--frozen", "--offline", "--package", "miles-core", "--no-dev", "--no-editable", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"uv sync of the bare environment failed:\n{result.stderr}"
    python = str(root / "venv" / "bin" / "python")
    miles = root / "venv" / "bin" / "miles"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0, "the bare environment must not have torch"
    return miles


def _run(miles: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(cwd / "cache")
    # An empty model cache: a tiny model another test built must not spare the bare install its build.
    env["MILES_CACHE_DIR"] = str(cwd / "miles-cache")
    return subprocess.run([str(miles), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_builtin_recipe_names_the_extra_of_its_fsdp_section(bare: Path, tmp_path: Path) -> None:
    line = _one_error(_run(bare, "run", cwd=tmp_path))
    assert re.fullmatch(
        r"Error: recipe 'default': key 'fsdp' \(default\.yaml:\d+\) is the config section of miles-fsdp, "
        r"which is not installed: pip install 'miles-core\[fsdp\]'",
        line,
    ), line


def test_user_recipe_names_the_extras_of_backend_and_transport(bare: Path, tmp_path: Path) -> None:
    (tmp_path / "user.yaml").write_text(USER_RECIPE)
    result = _run(bare, "run", "user.yaml", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "Error: 2 component problems:",
        "  - backend: backend 'fsdp' is not installed: pip install 'miles-core[fsdp]' (provides it: miles-fsdp)",
        "  - transport: transport 'broadcast' is not installed: pip install 'miles-core[transports]' "
        "(provides it: miles-transports)",
    ]


def test_agentic_recipe_names_the_extra_of_miles_envs(bare: Path, tmp_path: Path) -> None:
    """The agentic stack is a plugin: without miles-envs, its section and commands are not there."""
    (tmp_path / "agent.yaml").write_text(USER_RECIPE + "agentic:\n  family: qwen3\n")
    line = _one_error(_run(bare, "run", "agent.yaml", cwd=tmp_path))
    assert re.fullmatch(
        r"Error: recipe agent\.yaml: key 'agentic' \(agent\.yaml:\d+\) is the config section of miles-envs, "
        r"which is not installed: pip install 'miles-core\[envs\]'",
        line,
    ), line
    listed = _run(bare, "--help", cwd=tmp_path).stdout
    assert "serve" not in listed and "check-family" not in listed
    assert _run(bare, "serve", cwd=tmp_path).returncode == 2  # click: no such command


def test_models_build_without_transformers_is_one_line(bare: Path, tmp_path: Path) -> None:
    line = _one_error(_run(bare, "models", "build", "tiny-qwen3", cwd=tmp_path))
    assert line == (
        "Error: this needs transformers, which is not installed: pip install 'miles-core[engine]' "
        "(-v shows where it was imported)"
    )
    verbose = _run(bare, "-v", "models", "build", "tiny-qwen3", cwd=tmp_path)
    assert verbose.returncode == 1
    assert "Traceback" in verbose.stderr and "ModuleNotFoundError: No module named 'transformers'" in (
        verbose.stderr
    )


def test_run_that_reaches_the_model_is_one_line(bare: Path, tmp_path: Path) -> None:
    """Backend and transport by import path pass the component check; the model needs the engine extra."""
    (tmp_path / "user.yaml").write_text(USER_RECIPE)
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    overrides = ["--set", "backend=mymod:Backend", "--set", "transport=mymod:Transport"]
    # TensorBoard (on by default) needs the tracking extra, and says so first.
    line = _one_error(_run(bare, "run", "user.yaml", "--dry-run", *overrides, cwd=tmp_path))
    assert line == (
        "Error: tracker 'tensorboard' needs tensorboard, which is not installed: "
        "pip install 'miles-core[tracking]' (or drop it from the tracking section)"
    )
    overrides += ["--set", "tracking.tensorboard=false"]
    for command in (["run", "user.yaml", "--dry-run"], ["config", "validate", "user.yaml", "--check"]):
        line = _one_error(_run(bare, *command, *overrides, cwd=tmp_path))
        assert re.fullmatch(
            r"Error: this needs (torch|transformers), which is not installed: "
            r"pip install 'miles-core\[engine\]' \(-v shows where it was imported\)",
            line,
        ), line


def test_listing_and_help_work_in_a_bare_install(bare: Path, tmp_path: Path) -> None:
    assert _run(bare, "--help", cwd=tmp_path).returncode == 0
    listing = _run(bare, "plugins", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "miles-core" in listing.stdout


def test_every_extra_in_the_hint_table_exists() -> None:
    extras = tomllib.loads((CORE / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    providers = [
        *hints.COMPONENTS.values(),
        *hints.KINDS.values(),
        *hints.SECTIONS.values(),
        *hints.LIBRARIES.values(),
    ]
    for provider in providers:
        assert provider.extra in extras, provider
        if provider.distribution is not None:
            # The extra really installs the distribution it names.
            assert any(dep.startswith(provider.distribution) for dep in extras[provider.extra]), provider


def test_hints_stay_quiet_when_the_provider_is_installed() -> None:
    """In the workspace miles-fsdp is installed: an unknown name there is a real typo, not a missing extra."""
    assert hints.component_hint("backend", "fsdp") is None
    assert hints.section_hint("fsdp") is None
    assert hints.kind_hint("agent") is None  # miles-envs declares it here
    assert hints.missing_library(ModuleNotFoundError("x", name="torch")) is None  # torch is installed here
    if _importable("sglang"):
        pytest.skip("sglang is installed here")
    err = ModuleNotFoundError("No module named 'sglang.srt'", name="sglang.srt")
    assert hints.missing_library(err) == (
        "this needs sglang, which is not installed: pip install 'miles-core[sglang]'"
    )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
