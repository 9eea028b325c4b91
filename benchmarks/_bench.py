"""Helpers shared by the benchmark scripts: machine description, subprocess timing, metrics files.

Kept free of heavy imports: ``startup.py`` uses it and must not pull torch into its own process.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a number: when, on what CPU/RAM, with which library versions."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "python": platform.python_version(),
        "load_avg_at_start": load_avg(),
    }
    for dist in ("torch", "transformers", "trl", "miles-core", "miles-fsdp", "reasoning-gym"):
        info[dist] = _version(dist)
    return info


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def miles_executable() -> str:
    """The ``miles`` console script of the interpreter running the benchmark (the workspace venv)."""
    beside = Path(sys.executable).parent / "miles"
    if beside.exists():
        return str(beside)
    found = shutil.which("miles")
    if found is None:
        raise SystemExit(
            "cannot find the `miles` command; run the benchmark with `uv run python benchmarks/...`"
        )
    return found


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a benchmarked subprocess: fixed torch thread count, offline, quiet."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "MILES_TORCH_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@dataclass
class Timed:
    seconds: float
    cpu_s: float  # user+sys of the process and the descendants it waited for: robust to a busy machine
    returncode: int
    stdout: str
    stderr: str


def run_timed(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> Timed:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(seconds, cpu, proc.returncode, proc.stdout, proc.stderr)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
