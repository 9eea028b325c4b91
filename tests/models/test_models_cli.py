"""``miles models list`` and ``miles models build``."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from miles.cli.models import models
from miles.errors import ModelError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


def _row(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(name + " "))


def test_list_build_list(cache: Path) -> None:
    pytest.importorskip("transformers")
    runner = CliRunner()
    listed = runner.invoke(models, ["list"])
    assert listed.exit_code == 0, listed.output
    assert listed.output.splitlines()[0].split() == ["NAME", "KIND", "PARAMS", "PATH"]
    row = _row(listed.output, "tiny-qwen3").split()
    assert row == ["tiny-qwen3", "dense", "~221.9K", "not", "built"]
    assert _row(listed.output, "tiny-qwen3-moe").split()[1] == "moe"
    assert _row(listed.output, "smollm2-135m-instruct").split()[1:3] == ["pretrained", "~134.5M"]

    built = runner.invoke(models, ["build", "tiny-qwen3"])
    assert built.exit_code == 0, built.output
    assert f"built tiny-qwen3 at {cache / 'tiny-qwen3'}" in built.output
    assert (cache / "tiny-qwen3" / "config.json").is_file()

    row = _row(runner.invoke(models, ["list"]).output, "tiny-qwen3").split()
    assert row[2] == "221.9K" and row[3] == str(cache / "tiny-qwen3")

    again = runner.invoke(models, ["build", "tiny-qwen3"])
    assert "already built" in again.output and "--force" in again.output
    stamp = (cache / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns
    forced = runner.invoke(models, ["build", "tiny-qwen3", "--force"])
    assert forced.exit_code == 0 and "built tiny-qwen3" in forced.output
    assert (cache / "tiny-qwen3" / "model.safetensors").stat().st_mtime_ns != stamp


def test_build_unknown_name_is_a_model_error(cache: Path) -> None:
    result = CliRunner().invoke(models, ["build", "tiny-llama"])
    assert isinstance(result.exception, ModelError)
    assert "unknown built-in model 'tiny-llama'" in str(result.exception)
    assert not cache.exists() or not any(cache.iterdir())
