"""Importing the evaluator (as the driver does) must not pull in torch, transformers or aiohttp."""

from __future__ import annotations

import subprocess
import sys


def test_eval_package_imports_light() -> None:
    code = (
        "import sys\n"
        "import miles.eval, miles.eval.external, miles.eval.dedicated, miles.eval.snapshot\n"
        "print(sorted({'torch', 'transformers', 'tokenizers', 'aiohttp'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
