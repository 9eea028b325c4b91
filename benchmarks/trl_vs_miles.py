"""TRL's GRPOTrainer and `miles run`, side by side, on the SmolLM2 chain_sum recipe: seconds per step.

Both sides train the same model (SmolLM2-135M-Instruct, the dequantized folder Miles caches) on the same
reasoning-gym prompts with the same chat formatting, the same group size, prompts per step, generation
length, sampling temperature, learning rate, micro-batch size and number of optimizer steps. One
invocation runs both, one after the other, ``--repeats`` times with the order alternating, so that a
noisy machine hurts both alike. Each side runs in its own process with the same torch thread count.

    uv run --group bench python benchmarks/trl_vs_miles.py --steps 4 --repeats 1

Per side it reports the median seconds per optimizer step over every step but the first (warm-up),
pooled over the repeats, with a rollout/train breakdown, and the ratio TRL / Miles. The JSON result
goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import (
    RESULTS_DIR,
    fmt,
    load_avg,
    machine_info,
    median,
    miles_executable,
    read_metrics,
    run_timed,
    tail,
    thread_env,
    write_result,
)
from _trl_timing import timed_grpo

# Where the two sides cannot do exactly the same thing; printed with the result and kept in the JSON.
DIFFERENCES = [
    "Miles generates in a separate engine process (the embedded HF engine, over HTTP, continuous batching "
    "with a KV cache) and pushes the new weights to it after every optimizer step (time/weight_update_s, "
    "counted in Miles' step); TRL generates with the policy model inside the trainer process (one padded "
    "`generate` call per step), so it has no weight update to do.",
    "Both stop a sequence at EOS or after max_new_tokens, so the number of tokens generated and trained on "
    "depends on what each policy samples, and the two policies drift apart as they learn: each side's mean "
    "completion length and tokens per step are reported, and train time per token compares the training "
    "part on equal terms.",
    "Loss arithmetic differs (TRL: its default 'dapo' loss, beta=0; Miles: the recipe's ppo_clip loss with "
    "the TIS correction). Neither side runs a separate old-logprob pass (one optimizer step per rollout), "
    "so both do one forward and one backward per micro-batch; the loss arithmetic itself is negligible.",
    "Each side keeps its own optimizer implementation (TRL: transformers' default fused AdamW; Miles: "
    "torch.optim.AdamW on an FSDP2-sharded model, one rank). TRL's bf16 and gradient-checkpointing defaults "
    "are turned off so both train in float32 without recomputation, as the recipe does.",
]


# --------------------------------------------------------------------------- the shared setting


def load_setting(recipe: str, threads: int, device: str) -> dict[str, Any]:
    """The recipe's knobs both sides must honour, read through Miles' own recipe loader."""
    from miles.config import load_recipe

    config = load_recipe(recipe, [])
    if config.data.source != "reasoning_gym":
        raise SystemExit(
            f"recipe {recipe!r} reads data.source={config.data.source!r}; this benchmark "
            "builds TRL's prompts with reasoning_gym and needs data.source: reasoning_gym"
        )
    r, t = config.rollout, config.train
    total = r.prompts_per_step * r.n_samples_per_prompt
    if total % t.micro_batch_size:
        raise SystemExit(
            f"prompts_per_step * n_samples_per_prompt = {total} is not a multiple of "
            f"train.micro_batch_size = {t.micro_batch_size}; TRL needs whole micro-batches"
        )
    return {
        "recipe": recipe,
        "model": config.model.path,
        "dtype": config.model.dtype,
        "task": config.data.path,
        "task_options": dict(config.data.options),
        "data_seed": config.data.seed,
        "system_prompt": config.data.system_prompt,
        "prompt_template": config.data.prompt_template,
        "prompts_per_step": r.prompts_per_step,
        "n_samples_per_prompt": r.n_samples_per_prompt,
        "completions_per_step": total,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "lr": t.lr,
        "weight_decay": t.weight_decay,
        "betas": list(t.betas),
        "eps": t.eps,
        "grad_clip": t.grad_clip,
        "micro_batch_size": t.micro_batch_size,
        "seed": config.run.seed,
        "threads": threads,
        "device": device,
    }


def chat_prompt(setting: dict[str, Any], question: str) -> list[dict[str, str]]:
    messages = []
    if setting["system_prompt"]:
        messages.append({"role": "system", "content": setting["system_prompt"]})
    messages.append({"role": "user", "content": setting["prompt_template"].format(prompt=question)})
    return messages


def scored_answer(text: str) -> str:
    """What the reward scores, as Miles' reasoning_gym reward does: the last <answer>...</answer>, else all."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else text.strip()


def reasoning_gym_dataset(setting: dict[str, Any]):
    import reasoning_gym

    options = dict(setting["task_options"])
    options.setdefault("seed", setting["data_seed"])
    return reasoning_gym.create_dataset(setting["task"], **options)


def check_same_prompts(setting: dict[str, Any]) -> int:
    """Fail loudly unless TRL's dataset holds, entry by entry, the prompts and answers Miles trains on."""
    from miles.config import load_recipe
    from miles.plugins import make_component

    config = load_recipe(setting["recipe"], [])
    source = make_component("data_source", config.data.source, config.data.model_dump(exclude={"source"}))
    miles_prompts = {p.index: (p.prompt, p.label) for p in source.next_prompts(len(source))}
    ours = {
        i: (chat_prompt(setting, e["question"]), e["answer"])
        for i, e in enumerate(reasoning_gym_dataset(setting))
    }
    if miles_prompts != ours:
        differ = sorted(i for i in set(miles_prompts) | set(ours) if miles_prompts.get(i) != ours.get(i))
        i = differ[0]
        raise SystemExit(
            f"TRL's prompts differ from the Miles data source's at {len(differ)} entries; entry {i}: "
            f"Miles {miles_prompts.get(i)!r}, TRL {ours.get(i)!r}"
        )
    return len(ours)


# --------------------------------------------------------------------------- TRL side (worker process)


def trl_worker(spec_path: str, result_path: str) -> None:
    t_start = time.perf_counter()
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    setting = spec["setting"]

    import torch

    torch.set_num_threads(setting["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    rg = reasoning_gym_dataset(setting)
    rows = [{"prompt": chat_prompt(setting, entry["question"]), "rg_index": i} for i, entry in enumerate(rg)]
    dataset = Dataset.from_list(rows)

    def chain_sum_reward(completions: list, rg_index: list[int], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            float(rg.score_answer(answer=scored_answer(t), entry=rg[i]))
            for t, i in zip(texts, rg_index, strict=True)
        ]

    dtype = getattr(torch, setting["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])

    per_step = setting["completions_per_step"]
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        num_generations=setting["n_samples_per_prompt"],
        per_device_train_batch_size=setting["micro_batch_size"],
        gradient_accumulation_steps=per_step // setting["micro_batch_size"],
        generation_batch_size=per_step,  # one generation round feeds exactly one optimizer step
        max_completion_length=setting["max_new_tokens"],
        temperature=setting["temperature"],
        top_p=setting["top_p"],
        top_k=max(setting["top_k"], 0),  # Miles: -1 = off; TRL: 0 = off
        learning_rate=setting["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=setting["weight_decay"],
        adam_beta1=setting["betas"][0],
        adam_beta2=setting["betas"][1],
        adam_epsilon=setting["eps"],
        max_grad_norm=setting["grad_clip"] or 0.0,
        beta=0.0,
        num_iterations=1,
        use_cpu=setting["device"] == "cpu",
        bf16=False,  # TRL turns bf16 on by default; Miles trains in the recipe's model.dtype
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is on; Miles' FSDP backend's is off
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=setting["seed"],
    )
    sync = torch.cuda.synchronize if setting["device"] == "cuda" else (lambda: None)

    timer, TimedGRPOTrainer = timed_grpo(sync)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[chain_sum_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    step_s, rollout_s = timer.step_s, trainer.rollout_s
    result = {
        "step_s": step_s,
        "rollout_s": rollout_s,
        "train_s": [s - r for s, r in zip(step_s, rollout_s, strict=False)],
        "reward_mean": [log.get("reward") for log in timer.logs],
        "response_len_mean": [log.get("completions/mean_length") for log in timer.logs],
        # TRL logs a running total of the step's real (unpadded) prompt + completion tokens.
        "tokens": _per_step([log.get("num_tokens") for log in timer.logs]),
        "startup_s": (timer.first_step_at or time.perf_counter()) - t_start,
        "torch_threads": torch.get_num_threads(),
        "generation_batch_size": config.generation_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "optim": str(config.optim),
    }
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def _per_step(running_totals: list[Any]) -> list[float | None]:
    out: list[float | None] = []
    previous = 0.0
    for total in running_totals:
        if total is None:
            out.append(None)
            continue
        out.append(float(total) - previous)
        previous = float(total)
    return out


def run_trl(
    setting: dict[str, Any], model_dir: str, steps: int, workdir: Path, timeout: float
) -> dict[str, Any]:
    spec_path, result_path = workdir / "trl_spec.json", workdir / "trl_result.json"
    spec = {
        "setting": setting,
        "model_dir": model_dir,
        "steps": steps,
        "output_dir": str(workdir / "trl_out"),
    }
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "trl",
        "--spec",
        str(spec_path),
        "--worker-result",
        str(result_path),
    ]
    timed = run_timed(cmd, env=thread_env(setting["threads"]), timeout=timeout)
    run: dict[str, Any] = {
        "side": "trl",
        "wall_s": timed.seconds,
        "cpu_s": timed.cpu_s,
        "ok": timed.returncode == 0,
    }
    if timed.returncode != 0 or not result_path.exists():
        run.update(ok=False, error=f"exit code {timed.returncode}", stderr_tail=tail(timed.stderr))
        return run
    run.update(json.loads(result_path.read_text(encoding="utf-8")))
    return run


# --------------------------------------------------------------------------- Miles side


def miles_overrides(setting: dict[str, Any], steps: int, output_dir: Path, name: str) -> list[str]:
    overrides = [
        f"run.num_steps={steps}",
        f"run.name={name}",
        f"run.output_dir={output_dir}",
        "run.save_every=null",  # TRL saves nothing inside its steps either
        "run.export_hf=false",
        "tracking.console=false",
        "tracking.tensorboard=false",  # TRL runs with report_to=[]
        f"fsdp.torch_threads={setting['threads']}",
        f"engine.options.torch_threads={setting['threads']}",
    ]
    if setting["device"] == "cuda":
        # One GPU, as TRL uses: trainer and engine share it, so weights go over the colocated hand-off
        # (NCCL broadcast cannot join two processes on one GPU).
        overrides += ["fsdp.device=cuda", "engine.device=cuda", "transport=colocated"]
    return overrides + list(setting.get("miles_overrides", []))


def run_miles(setting: dict[str, Any], steps: int, workdir: Path, timeout: float) -> dict[str, Any]:
    name = "bench"
    cmd = [miles_executable(), "run", setting["recipe"], "--overwrite"]
    for o in miles_overrides(setting, steps, workdir / "miles_runs", name):
        cmd += ["--set", o]
    timed = run_timed(cmd, env=thread_env(setting["threads"]), timeout=timeout)
    run: dict[str, Any] = {
        "side": "miles",
        "wall_s": timed.seconds,
        "cpu_s": timed.cpu_s,
        "ok": timed.returncode == 0,
        "command": " ".join(cmd),
    }
    metrics = workdir / "miles_runs" / name / "metrics.jsonl"
    if timed.returncode != 0 or not metrics.exists():
        run.update(ok=False, error=f"exit code {timed.returncode}", stderr_tail=tail(timed.stderr))
        return run
    rows = read_metrics(metrics)

    def col(key: str) -> list[float | None]:
        return [row.get(key) for row in rows]

    run.update(
        step_s=col("time/step_s"),
        rollout_s=col("time/rollout_s"),
        train_s=col("time/train_step_s"),
        weight_update_s=col("time/weight_update_s"),
        reward_mean=col("rollout/reward_mean"),
        response_len_mean=col("rollout/response_len_mean"),
        tokens=col("train/num_tokens"),  # real (unpadded) prompt + response tokens trained on
        samples=col("rollout/samples"),
    )
    if len(rows) != steps:
        run.update(ok=False, error=f"metrics.jsonl holds {len(rows)} rows for {steps} steps")
    return run


# --------------------------------------------------------------------------- summary


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per key over every step but each run's first, pooled over the repeats."""
    summary: dict[str, Any] = {}
    for side in ("trl", "miles"):
        ok = [r for r in runs if r["side"] == side and r.get("ok")]
        if not ok:
            summary[side] = None
            continue
        side_sum: dict[str, Any] = {"runs": len(ok)}
        for run in ok:
            # Training cost grows with the tokens trained on, which differ as the two policies sample
            # differently: per-token train time compares the backends on equal terms.
            run["train_ms_per_token"] = [
                1000 * t / n if t is not None and n else None
                for t, n in zip(run.get("train_s") or [], run.get("tokens") or [], strict=False)
            ]
        keys = (
            "step_s",
            "rollout_s",
            "train_s",
            "weight_update_s",
            "response_len_mean",
            "tokens",
            "train_ms_per_token",
            "reward_mean",
        )
        for key in keys:
            pooled = [v for r in ok for v in (r.get(key) or [])[1:] if v is not None]
            if pooled:
                side_sum[f"median_{key}"] = median(pooled)
                if key == "step_s":
                    side_sum["min_step_s"] = min(pooled)  # the least disturbed step on a shared machine
        side_sum["steps_measured"] = sum(max(len(r.get("step_s") or []) - 1, 0) for r in ok)
        side_sum["median_wall_s"] = median([r["wall_s"] for r in ok])
        # Start-up and shutdown: processes, model loading (Miles: engine and trainer ranks each load it).
        side_sum["median_outside_steps_s"] = median([r["wall_s"] - sum(r.get("step_s") or []) for r in ok])
        side_sum["median_cpu_s"] = median([r["cpu_s"] for r in ok if r.get("cpu_s") is not None])
        summary[side] = side_sum
    trl, miles = summary.get("trl"), summary.get("miles")
    if trl and miles and trl.get("median_step_s") and miles.get("median_step_s"):
        summary["ratio_trl_over_miles"] = trl["median_step_s"] / miles["median_step_s"]
        summary["ratio_trl_over_miles_min_step"] = trl["min_step_s"] / miles["min_step_s"]
    if trl and miles and trl.get("median_train_ms_per_token") and miles.get("median_train_ms_per_token"):
        summary["ratio_trl_over_miles_train_per_token"] = (
            trl["median_train_ms_per_token"] / miles["median_train_ms_per_token"]
        )
    return summary


def print_report(result: dict[str, Any]) -> None:
    s, st = result["summary"], result["setting"]
    print(
        f"\nSmolLM2 GRPO, {st['completions_per_step']} completions/step ({st['prompts_per_step']} prompts x "
        f"{st['n_samples_per_prompt']}), max {st['max_new_tokens']} new tokens, {st['device']}, "
        f"{st['threads']} torch threads"
    )
    columns = [
        ("step_s", "median_step_s", 2),
        ("min_s", "min_step_s", 2),
        ("rollout_s", "median_rollout_s", 2),
        ("train_s", "median_train_s", 2),
        ("wupd_s", "median_weight_update_s", 2),
        ("resp_len", "median_response_len_mean", 1),
        ("tokens", "median_tokens", 0),
        ("train_ms/tok", "median_train_ms_per_token", 2),
        ("wall_s", "median_wall_s", 1),
        ("outside_steps_s", "median_outside_steps_s", 1),
        ("cpu_s", "median_cpu_s", 1),
    ]
    print(
        f"{'side':6} {'runs':>4} {'steps':>5} "
        + " ".join(f"{name:>{max(len(name), 7)}}" for name, _, _ in columns)
    )
    for side in ("trl", "miles"):
        d = s.get(side)
        if not d:
            print(f"{side:6} failed (see the JSON result)")
            continue
        cells = " ".join(f"{fmt(d.get(key), digits):>{max(len(name), 7)}}" for name, key, digits in columns)
        print(f"{side:6} {d['runs']:>4} {d['steps_measured']:>5} {cells}")
    if "ratio_trl_over_miles" in s:
        print(
            f"ratio TRL/Miles: {s['ratio_trl_over_miles']:.2f} (median s/step), "
            f"{s['ratio_trl_over_miles_min_step']:.2f} (fastest step), "
            f"{fmt(s.get('ratio_trl_over_miles_train_per_token'))} (train time per token)"
        )
    print("\nDifferences between the two sides:")
    for line in result["differences"]:
        print(f"- {line}")
    for run in result["runs"]:
        if not run.get("ok"):
            print(
                f"\n{run['side']} (repeat {run['repeat']}) failed: {run.get('error')}\n{run.get('stderr_tail', '')}"
            )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per side, interleaved TRL/Miles, Miles/TRL, ..."
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both sides")
    p.add_argument("--recipe", default="smollm2-chain-sum")
    p.add_argument(
        "--out", default=None, help="JSON result (default benchmarks/results/trl_vs_miles-DEVICE.json)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per run")
    p.add_argument(
        "--miles-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override for the Miles run, after the benchmark's own (e.g. engine.device=cuda:1)",
    )
    p.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step is warm-up and not counted")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "trl":
        trl_worker(args.spec, args.worker_result)
        return 0

    from miles.models.registry import resolve_model

    setting = load_setting(args.recipe, args.threads, args.device)
    setting["miles_overrides"] = list(args.miles_set)
    n_prompts = check_same_prompts(setting)
    model_dir = resolve_model(setting["model"])  # dequantizes once, outside any timing
    machine = machine_info()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-") as tmp:
        for rep in range(args.repeats):
            order = ("trl", "miles") if rep % 2 == 0 else ("miles", "trl")
            for side in order:
                workdir = Path(tmp) / f"{side}-{rep}"
                workdir.mkdir()
                print(f"[repeat {rep + 1}/{args.repeats}] {side}: {args.steps} steps ...", flush=True)
                load_before = load_avg()
                if side == "trl":
                    run = run_trl(setting, model_dir, args.steps, workdir, args.timeout)
                else:
                    run = run_miles(setting, args.steps, workdir, args.timeout)
                run.update(repeat=rep, load_avg_before=load_before, load_avg_after=load_avg())
                runs.append(run)
                steps = run.get("step_s") or []
                print(
                    f"    ok={run['ok']} wall {run['wall_s']:.1f}s, s/step {[round(x, 2) for x in steps if x]}",
                    flush=True,
                )
    result = {
        "benchmark": "trl_vs_miles",
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "spec", "worker_result")},
        "machine": machine,
        "setting": setting,
        "prompts_checked_identical": n_prompts,
        "model_dir": model_dir,
        "differences": DIFFERENCES,
        "runs": runs,
        "summary": summarize(runs),
    }
    out = write_result(args.out or RESULTS_DIR / f"trl_vs_miles-{args.device}.json", result)
    print_report(result)
    print(f"\nresult: {out}")
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
