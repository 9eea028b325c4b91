"""How fast `miles` starts, and whether starting it imports heavy libraries.

    uv run python benchmarks/startup.py --runs 10

Measures, each as the median of ``--runs`` fresh processes: the bare interpreter (``python -c pass``, the
floor), ``python -c "import miles"``, ``miles --help`` and ``miles run --help``. Then checks, inside one
process that ran the CLI's help, that none of torch, transformers, fastapi, uvicorn, ray, sglang or
megatron was imported, and lists the slowest imports of ``miles.cli`` (``python -X importtime``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from _bench import RESULTS_DIR, fmt, machine_info, median, miles_executable, run_timed, tail, write_result

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "ray", "sglang", "megatron", "datasets", "pyarrow")

# Runs the CLI's help in-process, then reports which heavy modules that pulled in.
_PROBE = """
import json, sys
from miles.cli import main  # the console script's entry point
for argv in ({argvs}):
    sys.argv = ["miles", *argv]
    try:
        main()
    except SystemExit:
        pass
heavy = {heavy!r}
print("HEAVY=" + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy and "." not in m)))
"""


def time_command(cmd: list[str], runs: int) -> dict[str, Any]:
    times, failures = [], []
    for _ in range(runs):
        t = run_timed(cmd, timeout=120)
        if t.returncode != 0:
            failures.append(tail(t.stderr, 10))
        else:
            times.append(t.seconds)
    return {
        "command": " ".join(cmd),
        "runs": len(times),
        "median_s": median(times),
        "min_s": min(times) if times else None,
        "max_s": max(times) if times else None,
        "failures": failures[:1],
    }


def heavy_imports(argvs: list[list[str]]) -> dict[str, Any]:
    code = _PROBE.format(argvs=", ".join(repr(a) for a in argvs) + ",", heavy=HEAVY)
    t = run_timed([sys.executable, "-c", code], timeout=120)
    line = next((ln for ln in t.stdout.splitlines() if ln.startswith("HEAVY=")), None)
    if line is None:
        return {"ok": False, "error": f"probe exited {t.returncode}: {tail(t.stderr, 10)}"}
    found = json.loads(line[len("HEAVY=") :])
    return {"ok": not found, "heavy_modules_imported": found}


def slowest_imports(module: str, top: int) -> list[dict[str, Any]]:
    """Largest cumulative import times per top-level package, from ``python -X importtime``."""
    t = run_timed([sys.executable, "-X", "importtime", "-c", f"import {module}"], timeout=120)
    per_pkg: dict[str, int] = {}
    for line in t.stderr.splitlines():
        # "import time: <self us> | <cumulative us> | <indented module name>"
        if not line.startswith("import time:"):
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        package = parts[2].strip().split(".")[0]
        per_pkg[package] = max(per_pkg.get(package, 0), int(parts[1]))
    ranked = sorted(per_pkg.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return [{"package": k, "cumulative_ms": v / 1000} for k, v in ranked]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS_DIR / "startup.json"))
    args = p.parse_args(argv)

    miles = miles_executable()
    py = sys.executable
    timings = {
        "python -c pass": time_command([py, "-c", "pass"], args.runs),
        "python -c 'import miles'": time_command([py, "-c", "import miles"], args.runs),
        "miles --help": time_command([miles, "--help"], args.runs),
        "miles run --help": time_command([miles, "run", "--help"], args.runs),
    }
    check = heavy_imports([["--help"], ["run", "--help"]])
    result = {
        "benchmark": "startup",
        "machine": machine_info(),
        "args": vars(args),
        "timings": timings,
        "heavy_import_check": check,
        "slowest_imports_of_miles_cli": slowest_imports("miles.cli", 8),
    }
    out = write_result(args.out, result)

    print(f"{'command':28} {'median_s':>9} {'min_s':>7} {'max_s':>7} runs")
    for name, t in timings.items():
        print(
            f"{name:28} {fmt(t['median_s'], 3):>9} {fmt(t['min_s'], 3):>7} {fmt(t['max_s'], 3):>7} {t['runs']}"
        )
        if t["failures"]:
            print(f"  failed: {t['failures'][0]}")
    verdict = "none" if check.get("ok") else check.get("heavy_modules_imported") or check.get("error")
    print(f"heavy modules imported by `miles --help` / `miles run --help`: {verdict}")
    print(
        "slowest imports of miles.cli (cumulative ms): "
        + ", ".join(
            f"{r['package']} {r['cumulative_ms']:.0f}" for r in result["slowest_imports_of_miles_cli"]
        )
    )
    print(f"result: {out}")
    ok = check.get("ok") and all(t["runs"] == args.runs for t in timings.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
