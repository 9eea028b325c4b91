"""Synchronous vs fully asynchronous schedule under heavy-tailed episode latencies (tiny model, CPU).

    uv run --group bench python benchmarks/fully_async.py [--steps 12] [--repeats 2]

Both schedules run the default recipe with the ``heavy_tail_env`` generate function
(log-normal episode latencies, identical for both runs) and no group filter, so every
step trains on exactly prompts_per_step x n_samples_per_prompt samples. Reported:

- trained samples per second over the measured steps (the first ``--warmup`` are skipped);
- the bound: prompts_per_step x n / max(rollout time, train time) per step, where the
  rollout time is a batch's trajectories x the mean episode time (over every trajectory the
  asynchronous run finished) / the trajectories the worker keeps in flight, and the train time
  is the synchronous run's trainer time per step (score, train, weight update; measured
  without generation competing for the CPU);
- queue size and staleness per step of the asynchronous run, plotted to docs/img.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # heavy_tail_env is imported by path from the recipe

from miles import hookimpl  # noqa: E402
from miles.config import load_recipe  # noqa: E402
from miles.loop import train  # noqa: E402
from miles.plugins import get_plugin_manager  # noqa: E402


class StepLog:
    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}
        self.episode_s: list[float] = []  # every finished trajectory, trained or not

    @hookimpl
    def miles_rollout_postprocess(self, groups, step):
        self.episode_s.extend(s.metadata.get("episode_s", 0.0) for g in groups for s in g.samples)

    @hookimpl
    def miles_on_metrics(self, step, metrics):
        self.rows[step] = dict(metrics)


def run_once(schedule: str, args, out_dir: str) -> StepLog:
    overrides = [
        f"run.output_dir={out_dir}",
        f"run.name={schedule}",
        f"run.num_steps={args.steps}",
        "run.export_hf=false",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.filters=[]",
        "rollout.generate_fn=heavy_tail_env:heavy_tail_generate",
        f"rollout.options={{latency_median_s: {args.median}, latency_sigma: {args.sigma}}}",
        "tracking.console=false",
        "tracking.tensorboard=false",
        f"schedule={schedule}",
        f"fully_async.max_inflight={args.inflight}",
        f"fully_async.max_staleness={args.max_staleness}",
    ]
    if args.device == "cuda":  # disaggregated: the trainer on cuda:0, the engine on cuda:1
        overrides += ["fsdp.device=cuda", "engine.device=cuda:1"]
    config = load_recipe("default", overrides)
    import heavy_tail_env

    heavy_tail_env.reset_attempts()
    log = StepLog()
    pm = get_plugin_manager()
    pm.register(log)
    try:
        train(config, overwrite=True)
    finally:
        pm.unregister(log)
    return log


def summarize(sync: StepLog, fa: StepLog, args) -> dict:
    steps = range(args.warmup, args.steps)
    batch = args.prompts * args.n

    def per_s(log: StepLog) -> float:
        return batch * len(steps) / sum(log.rows[s]["time/step_s"] for s in steps)

    train_time = statistics.median(
        sync.rows[s]["time/step_s"] - sync.rows[s]["time/rollout_s"] for s in steps
    )
    # The engines kept busy produce max_inflight trajectories per mean episode time. The mean is over
    # every trajectory the run finished: a per-batch figure would under-count the stragglers.
    rollout_time = batch * statistics.fmean(fa.episode_s) / args.inflight
    bound = batch / max(train_time, rollout_time)
    # The same bound with the trainer's time as measured in the asynchronous run itself, where it
    # shares the CPU with the engine and the rollout worker (on separate GPUs it would not).
    async_train_time = statistics.fmean(
        fa.rows[s]["time/step_s"] - fa.rows[s]["time/wait_for_batch_s"] for s in steps
    )
    shared_cpu_bound = batch / max(async_train_time, rollout_time)
    sync_rate, fa_rate = per_s(sync), per_s(fa)
    return {
        "sync_samples_per_s": sync_rate,
        "fully_async_samples_per_s": fa_rate,
        "speedup": fa_rate / sync_rate,
        "bound_samples_per_s": bound,
        "fraction_of_bound": fa_rate / bound,
        "shared_cpu_bound_samples_per_s": shared_cpu_bound,
        "fraction_of_shared_cpu_bound": fa_rate / shared_cpu_bound,
        "fully_async_train_time_per_step_s": async_train_time,
        "train_time_per_step_s": train_time,
        "rollout_time_per_step_s": rollout_time,
        "sync_median_step_s": statistics.median(sync.rows[s]["time/step_s"] for s in steps),
        "fully_async_median_step_s": statistics.median(fa.rows[s]["time/step_s"] for s in steps),
        "fully_async_median_wait_s": statistics.median(fa.rows[s]["time/wait_for_batch_s"] for s in steps),
        "fully_async_mean_inflight": statistics.fmean(
            fa.rows[s]["rollout/fully_async/inflight_samples"] for s in steps
        ),
        "fully_async_stale_groups": sum(
            fa.rows[s]["rollout/fully_async/stale_groups_filtered"] for s in steps
        ),
        "fully_async_mean_queue": statistics.fmean(
            fa.rows[s]["rollout/fully_async/queue_size"] for s in steps
        ),
    }


def plot(fa: StepLog, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(fa.rows)
    get = lambda key: [fa.rows[s][f"rollout/fully_async/{key}"] for s in steps]  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, get("queue_size"), marker="o")
    ax1.set(title="queue size when the step collected its batch", xlabel="step", ylabel="groups")
    ax2.plot(steps, get("avg_staleness"), marker="o", label="drawn, mean")
    ax2.plot(steps, get("max_staleness"), marker="x", label="drawn, max")
    ax2.plot(steps, get("buffer_max_staleness"), linestyle="--", label="still waiting, max")
    ax2.set(title="staleness (versions)", xlabel="step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--median", type=float, default=0.15)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument(
        "--max-staleness", default="8", help="fully_async.max_staleness ('null': never drop for staleness)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    args = parser.parse_args()
    results = []
    fa = None
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            t0 = time.perf_counter()
            sync = run_once("sync", args, tmp)
            fa = run_once("fully_async", args, tmp)
            summary = summarize(sync, fa, args)
            summary["wall_s"] = time.perf_counter() - t0
            results.append(summary)
            print(f"repeat {repeat}: " + ", ".join(f"{k}={v:.3g}" for k, v in summary.items()), flush=True)
    medians = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print("median: " + ", ".join(f"{k}={v:.3g}" for k, v in medians.items()))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    record = {
        "date": stamp,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "args": vars(args),
        "repeats": results,
        "median": medians,
    }
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    with open(os.path.join(args.out, f"fully_async_{stamp}{suffix}.json"), "w") as f:
        json.dump(record, f, indent=2)
    if args.no_plot:
        return
    img = os.path.join(HERE, "..", "docs", "img", f"fully_async_queue{suffix}.png")
    os.makedirs(os.path.dirname(img), exist_ok=True)
    plot(fa, img)
    print(f"wrote {img}")


if __name__ == "__main__":
    main()
