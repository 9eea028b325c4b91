"""Learning curves of the objectives on the tiny model, on CPU: SFT -> GRPO, and on-policy distillation.

    uv run --group bench python benchmarks/objective_curves.py [--out docs/img/objective_curves.png]

1. SFT (recipe ``sft-arith``): the supervised loss on assistant tokens should fall.
2. GRPO (recipe ``default``) starting from the SFT policy: the reward should rise.
3. OPD: a fresh (untrained) student distils from the SFT -> GRPO policy, served by its own
   embedded engine, with the task reward set to zero: the per-token reverse-KL estimate
   should fall, and the task reward (logged, not trained on) should rise with it.

Writes the figure and ``benchmarks/results/objective_curves.json`` (every curve, the
commands' settings, the machine and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MILES_TORCH_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]


def _run(recipe: str, overrides: list[str]) -> tuple[list[dict], str | None, float]:
    from miles.config import load_recipe
    from miles.loop import train

    config = load_recipe(recipe, [*overrides, "tracking.console=false", "tracking.tensorboard=false"])
    t0 = time.perf_counter()
    result = train(config, overwrite=True)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, result.final_dir, time.perf_counter() - t0


def _series(rows: list[dict], key: str) -> list[float | None]:
    return [r.get(key) for r in rows]


def _smooth(values: list[float | None], window: int = 5) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(statistics.fmean(recent) if recent else None)
    return out


def _ends(values: list[float | None], n: int = 5) -> tuple[float, float]:
    real = [v for v in values if v is not None]
    return statistics.fmean(real[:n]), statistics.fmean(real[-n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs/img/objective_curves.png"))
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--opd-steps", type=int, default=40)
    # Below the default recipe's 0.01: from a fine-tuned policy, large first steps undo the SFT before GRPO helps.
    parser.add_argument("--grpo-lr", type=float, default=0.003)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="miles-curves-")
    common = [f"run.output_dir={work}", "run.save_every=null"]
    sft_rows, sft_final, sft_s = _run(
        "sft-arith", [*common, "run.name=sft", f"run.num_steps={args.sft_steps}"]
    )
    grpo_rows, grpo_final, grpo_s = _run(
        "default",
        [
            *common,
            "run.name=grpo",
            f"run.num_steps={args.grpo_steps}",
            f"model.path={sft_final}",
            f"train.lr={args.grpo_lr}",
        ],
    )
    opd_rows, _, opd_s = _run(
        "default",
        [
            *common,
            "run.name=opd",
            f"run.num_steps={args.opd_steps}",
            f"distillation={{teachers: {{default: {{model: {grpo_final}}}}}, task_reward: zero}}",
            "rollout.filters=[]",
        ],
    )

    curves = {
        "sft/loss": _series(sft_rows, "train/loss"),
        "grpo/reward_mean": _series(grpo_rows, "rollout/reward_mean"),
        "opd/reverse_kl": _series(opd_rows, "distill/reverse_kl"),
        "opd/task_reward_mean": _series(opd_rows, "rollout/reward_mean"),
    }
    summary = {
        name: dict(zip(("first5_mean", "last5_mean"), _ends(v), strict=True)) for name, v in curves.items()
    }
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
        "command": "uv run --group bench python benchmarks/objective_curves.py",
        "steps": {"sft": args.sft_steps, "grpo": args.grpo_steps, "opd": args.opd_steps},
        "grpo_lr": args.grpo_lr,
        "seconds": {"sft": sft_s, "grpo": grpo_s, "opd": opd_s},
        "summary": summary,
        "curves": curves,
    }
    out_json = ROOT / "benchmarks/results/objective_curves.json"
    out_json.write_text(json.dumps(results, indent=2) + "\n")
    _plot(curves, args.out)
    print(json.dumps({"summary": summary, "seconds": results["seconds"]}, indent=2))
    print(f"wrote {args.out} and {out_json}")


def _plot(curves: dict[str, list[float | None]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        (axes[0], "1. SFT on arith_sft", [("sft/loss", "loss (assistant tokens)", "tab:blue")]),
        (
            axes[1],
            "2. GRPO from the SFT policy",
            [("grpo/reward_mean", "reward (numeric_closeness)", "tab:green")],
        ),
        (
            axes[2],
            "3. OPD: fresh student, served teacher",
            [
                ("opd/reverse_kl", "reverse KL estimate", "tab:red"),
                ("opd/task_reward_mean", "task reward (not trained on)", "tab:green"),
            ],
        ),
    ]
    for ax, title, series in panels:
        for key, label, color in series:
            values = curves[key]
            steps = list(range(len(values)))
            ax.plot(steps, [v if v is not None else float("nan") for v in values], color=color, alpha=0.3)
            ax.plot(
                steps,
                [v if v is not None else float("nan") for v in _smooth(values)],
                color=color,
                label=label,
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Miles objectives on tiny-qwen3, CPU (light: per step; dark: 5-step mean)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
