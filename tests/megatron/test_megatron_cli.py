"""``backend: megatron`` on a machine without CUDA: refused in one line before anything starts (real CLI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)

REFUSAL = "backend 'megatron' needs a CUDA GPU and none is visible on this machine"


def test_run_is_refused_in_one_line_before_the_run_directory_exists(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles",
            "run",
            "--set",
            "backend=megatron",
            "--set",
            f"run.output_dir={tmp_path}/runs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    text = out.stdout + out.stderr
    lines = [
        line for line in text.splitlines() if line.strip() and "Warning" not in line and "warn" not in line
    ]
    assert out.returncode == 1, text
    assert len(lines) == 1 and REFUSAL in lines[0], text
    assert "Traceback" not in text
    assert not (tmp_path / "runs").exists()


CHECK = textwrap.dedent(
    """
    import sys
    from click.testing import CliRunner
    from miles.cli import cli

    result = CliRunner().invoke(cli, ["config", "validate", "--check", "--set", "backend=megatron"])
    print("EXIT", result.exit_code)
    print("OUTPUT", result.output.strip().replace("\\n", " | "))
    bad = ["megatron.num_ranks=6", "megatron.tensor_parallel=4"]
    result = CliRunner().invoke(
        cli, ["config", "validate", "--check", "--set", "backend=megatron", *(a for b in bad for a in ("--set", b))]
    )
    print("LAYOUT_EXIT", result.exit_code)
    print("LAYOUT", result.output.strip().replace("\\n", " | "))
    print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
    """
)


def test_validate_check_refuses_without_importing_megatron(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert lines["EXIT"] == "1", out.stdout + out.stderr
    assert REFUSAL in lines["OUTPUT"] and " | " not in lines["OUTPUT"]
    assert lines["IMPORTED"] == "[]"
    # the recipe's own layout mistake is reported first, on any machine
    assert lines["LAYOUT_EXIT"] == "1"
    assert "TP x PP x CP = 4 x 1 x 1 = 4 does not divide the world of 6 ranks" in lines["LAYOUT"]
    assert " | " not in lines["LAYOUT"]


def test_validate_check_refuses_a_bad_offload_or_streaming_dir_in_one_line(tmp_path):
    """The directories are checked at pre-flight, before the CUDA check and any model work."""
    from click.testing import CliRunner

    from miles.cli import cli

    missing = tmp_path / "missing"
    for sets, said in [
        (["megatron.offload_to=disk", f"megatron.offload_dir={missing}"], "megatron.offload_dir"),
        (
            ["megatron.optimizer_streaming=true", f"megatron.optimizer_streaming_dir={missing}"],
            "megatron.optimizer_streaming_dir",
        ),
    ]:
        args = ["config", "validate", "--check", "--set", "backend=megatron"]
        result = CliRunner().invoke(cli, args + [a for s in sets for a in ("--set", s)])
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, result.output
        assert f"{said} {str(missing)!r} does not exist; allowed: an existing, writable directory" in lines[0]
