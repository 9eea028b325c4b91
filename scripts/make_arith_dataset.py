#!/usr/bin/env python3
"""Write miles/datasets/arith.jsonl: single-digit additions whose sum is a single digit.

The default recipe trains a randomly initialised tiny model on these, so the answer
space is kept to the ten digits. Deterministic: the file depends on nothing but this
script. ``--check`` exits non-zero if the shipped file differs from what this writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "packages/miles-core/src/miles/datasets/arith.jsonl"


def records() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


def render() -> str:
    return "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in records())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the shipped file instead of writing it")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date; run scripts/make_arith_dataset.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {len(records())} prompts to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
