"""Naming a model, a data source or an objective must not pull in the heavy libraries."""

from __future__ import annotations

import subprocess
import sys


def test_modules_import_without_torch_transformers_sympy_or_reasoning_gym() -> None:
    code = (
        "import sys\n"
        "import miles.models, miles.cli.models, miles.builtins.data.files, miles.builtins.data.hf\n"
        "import miles.builtins.data.reasoning_gym, miles.builtins.algorithms.grpo\n"
        "import miles.builtins.algorithms.ppo_clip, miles.builtins.algorithms.tis, miles.builtins.filters\n"
        "import miles.builtins.rewards.exact_match, miles.builtins.rewards.math, miles.builtins.rewards.reasoning_gym\n"
        "heavy = {'torch', 'transformers', 'tokenizers', 'sympy', 'reasoning_gym', 'datasets', 'pyarrow'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
