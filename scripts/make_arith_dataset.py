#!/usr/bin/env python3
"""Write miles/datasets/arith.jsonl and arith_sft.jsonl: single-digit additions whose sum is a digit.

The default recipe trains a randomly initialised tiny model on ``arith`` (prompt and
label), so the answer space is kept to the ten digits. ``arith_sft`` holds the same
problems as chat conversations with the answer as the assistant turn, for the SFT
recipe. Deterministic: the files depend on nothing but this script. ``--check`` exits
non-zero if a shipped file differs from what this writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATASETS = Path(__file__).resolve().parents[1] / "packages/miles-core/src/miles/datasets"


def records() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


def sft_records() -> list[dict[str, object]]:
    return [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["label"]}]}
        for r in records()
    ]


def render(rows: list) -> str:
    return "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows)


def files() -> dict[Path, str]:
    return {DATASETS / "arith.jsonl": render(records()), DATASETS / "arith_sft.jsonl": render(sft_records())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the shipped file instead of writing it")
    args = parser.parse_args()
    stale = 0
    for path, text in files().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                print(f"{path} is out of date; run scripts/make_arith_dataset.py", file=sys.stderr)
                stale += 1
            continue
        path.write_text(text)
        print(f"wrote {text.count(chr(10))} records to {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
