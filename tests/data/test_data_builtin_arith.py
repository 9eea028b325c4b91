"""The shipped dataset builtin:arith: every single-digit sum, regenerated exactly by its script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.builtins.data.files import FileDataSource, builtin_datasets
from miles.errors import DataError

ROOT = Path(__file__).resolve().parents[2]


def test_arith_holds_every_single_digit_sum() -> None:
    source = FileDataSource("builtin:arith", apply_chat_template=False, shuffle=False)
    prompts = source.next_prompts(len(source))
    assert 50 <= len(prompts) <= 100
    assert len({p.prompt for p in prompts}) == len(prompts)
    for p in prompts:
        a, b = p.prompt.removesuffix("=").split("+")
        assert len(a) == len(b) == 1 and p.label == str(int(a) + int(b))
        assert len(p.label) == 1
    assert {p.label for p in prompts} == {str(d) for d in range(10)}


def test_the_shipped_file_is_what_the_script_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_arith_dataset.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_builtin_names() -> None:
    assert "builtin:arith" in builtin_datasets()
    assert len(FileDataSource("builtin:arith.jsonl")) == len(FileDataSource("builtin:arith"))
    with pytest.raises(DataError, match=r"unknown built-in dataset 'gsm8k'; available: .*builtin:arith"):
        FileDataSource("builtin:gsm8k")
