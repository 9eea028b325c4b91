"""One GPU, the whole RL step: `miles run` against TRL's GRPOTrainer on the same random model and batch.

The setting of issue 15: a random Qwen3-0.6B-shaped model (bf16 compute, float32 master weights),
32 prompts x 8 samples a step, 256 new tokens each, gradient checkpointing on both sides, one
optimizer step per rollout. Both sides read the same prompts and score completions with the same
reward (a hash of the completion text: a random model cannot earn a meaningful one, and a reward
that varies within a group keeps every group in GRPO's batch). Each side runs in its own process,
one after the other, in one invocation:

    python3 benchmarks/trl_vs_miles_gpu.py --steps 5 --sides trl,miles,miles-files --out result.json

``miles`` is the one-GPU colocated configuration (paged engine, CUDA-IPC weight hand-off, the KV
cache released while the trainer trains, the trainer offloaded while the engine generates);
``miles-resident`` the same with the trainer kept on the GPU and the KV cache kept (both fit on one
H200 at this size); ``miles-files`` the colocated file hand-off with offload and no release, as
before issue 15. Reported per side: the median seconds per step over steps 2..N,
and for Miles the step's breakdown from its own ``time/`` metrics. Needs CUDA, TRL and `datasets`
(scripts/gpu-trl-bench.sh carries them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _trl_timing import timed_grpo

VOCAB = 151_936
SHAPES = {
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},  # --cpu-smoke only
}
REWARD_MODULE = '''
import hashlib


def hash_reward(sample) -> float:
    """A reward in [0, 1) from the response text (the same function as the TRL side's)."""
    digest = hashlib.blake2b(sample.response_text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64
'''


def text_reward(text: str) -> float:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


# --------------------------------------------------------------------------- the shared inputs


def write_model(root: Path, shape: str, seed: int) -> Path:
    """A random Qwen3 of the given shape (bf16 on disk) and a word-level tokenizer over its whole vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path = root / f"qwen3-{shape}-random"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
        **SHAPES[shape],
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return path


def prompts(n: int, length: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(length)) for _ in range(n)]


# --------------------------------------------------------------------------- TRL


def trl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    s = spec
    dataset = Dataset.from_list([{"prompt": p} for p in s["prompts"]])

    def reward(completions: list, **_: Any) -> list[float]:
        return [text_reward(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)  # float32 masters
    tokenizer = AutoTokenizer.from_pretrained(s["model_dir"])
    per_step = s["prompts_per_step"] * s["samples"]
    config = GRPOConfig(
        output_dir=s["output_dir"],
        max_steps=s["steps"],
        num_generations=s["samples"],
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=per_step // s["micro_batch_size"],
        generation_batch_size=per_step,
        max_completion_length=s["new_tokens"],
        temperature=1.0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        num_iterations=1,
        bf16=not s["cpu_smoke"],
        use_cpu=s["cpu_smoke"],
        gradient_checkpointing=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )

    sync = (lambda: None) if s["cpu_smoke"] else torch.cuda.synchronize

    timer, TimedGRPOTrainer = timed_grpo(sync)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    return {
        "step_s": timer.step_s,
        "rollout_s": trainer.rollout_s,
        "peak_gib": 0.0 if s["cpu_smoke"] else torch.cuda.max_memory_allocated() / 2**30,
    }


def run_trl(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    spec_path, result_path = workdir / "trl_spec.json", workdir / "trl_result.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    cmd = [sys.executable, __file__, "--worker", str(spec_path), str(result_path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    run: dict[str, Any] = {"side": "trl", "wall_s": time.perf_counter() - t0, "ok": proc.returncode == 0}
    if proc.returncode != 0 or not result_path.exists():
        return run | {"ok": False, "error": proc.stderr[-4000:]}
    return run | json.loads(result_path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- Miles


def miles_overrides(spec: dict[str, Any], variant: str, out: Path) -> list[str]:
    common = [
        f"run.num_steps={spec['steps']}",
        "run.name=bench",
        f"run.output_dir={out}",
        "run.save_every=null",
        "run.export_hf=false",
        "warm_start=null",
        "eval=null",
        "tracking.console=false",
        "tracking.tensorboard=false",
        f"model.path={spec['model_dir']}",
        "model.dtype=float32",  # the trainer's master weights; compute in bf16 below, as TRL does
        f"data.path={spec['data_path']}",
        "data.label_key=null",
        "data.apply_chat_template=false",  # plain text prompts, as TRL gets them
        "data.shuffle=false",
        "rollout.reward=gpu_bench_reward:hash_reward",
        f"rollout.prompts_per_step={spec['prompts_per_step']}",
        f"rollout.n_samples_per_prompt={spec['samples']}",
        f"rollout.max_new_tokens={spec['new_tokens']}",
        "rollout.temperature=1.0",
        "train.lr=1e-6",
        f"train.micro_batch_size={spec['micro_batch_size']}",
        "fsdp.device=cuda",
        "fsdp.param_dtype=bfloat16",
        "fsdp.gradient_checkpointing=true",
        "engine.device=cuda",
        "engine.dtype=bfloat16",
        f"engine.max_batch_size={spec['prompts_per_step'] * spec['samples']}",
    ]
    if spec["cpu_smoke"]:  # the same runs, shrunk to check the script on a machine without a GPU
        common = [
            o.replace("=cuda", "=cpu") for o in common if "param_dtype" not in o and "engine.dtype" not in o
        ]
        return [
            *common,
            "transport=colocated",
            "engine.options.kv_cache=paged",
            "engine.options.kv_tokens=8192",
        ]
    if variant == "miles-resident":  # the trainer stays on the GPU beside the KV cache: no copies a step
        return [
            *common,
            "transport=cuda-ipc",
            "placement.offload_trainer=false",
            "engine.options.mem_fraction=0.5",
        ]
    if variant == "miles":
        return [
            *common,
            "transport=cuda-ipc",
            "engine.release_memory=true",
            "engine.options.mem_fraction=0.5",
        ]
    return [*common, "transport=colocated", "engine.options.mem_fraction=0.3"]


def run_miles(spec: dict[str, Any], variant: str, workdir: Path, timeout: float) -> dict[str, Any]:
    out = workdir / variant
    cmd = [sys.executable, "-m", "miles", "run", "default", "--overwrite"]
    for o in miles_overrides(spec, variant, out):
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    run: dict[str, Any] = {"side": variant, "wall_s": time.perf_counter() - t0, "ok": proc.returncode == 0}
    metrics = out / "bench" / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        return run | {"ok": False, "error": (proc.stdout + proc.stderr)[-4000:]}
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    run["step_s"] = [r.get("time/step_s") for r in rows]
    run["rollout_s"] = [r.get("time/rollout_s") for r in rows]
    run["phases"] = [{k: v for k, v in r.items() if k.startswith("time/")} for r in rows]
    run["samples"] = [r.get("rollout/samples") for r in rows]
    run["response_len_mean"] = [r.get("rollout/response_len_mean") for r in rows]
    run["weight_sync_bytes"] = [r.get("weight_sync/bytes") for r in rows]
    return run


# --------------------------------------------------------------------------- report


def steady(values: list[Any]) -> float | None:
    """Median over every step but the first."""
    xs = [float(v) for v in values[1:] if v is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run in runs:
        side = run["side"]
        if not run.get("ok"):
            out[side] = {"error": run.get("error", "")[-600:]}
            continue
        summary = {"step_s": steady(run["step_s"]), "rollout_s": steady(run["rollout_s"])}
        if "phases" in run:
            names = sorted({k for p in run["phases"] for k in p})
            summary["phases"] = {k: steady([p.get(k) for p in run["phases"]]) for k in names}
        out[side] = summary
    trl = (out.get("trl") or {}).get("step_s")
    for side, summary in out.items():
        if side != "trl" and trl and summary.get("step_s"):
            summary["vs_trl"] = summary["step_s"] / trl
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--sides", default="trl,miles,miles-files")
    ap.add_argument("--workdir", default="/tmp/trl-vs-miles-gpu")
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU runs that check the script itself")
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text(encoding="utf-8"))
        Path(args.worker[1]).write_text(json.dumps(trl_worker(spec)), encoding="utf-8")
        return 0
    sides = args.sides.split(",")
    unknown = set(sides) - {"trl", "miles", "miles-resident", "miles-files"}
    if unknown:
        raise SystemExit(
            f"--sides: unknown {sorted(unknown)}; choose from trl, miles, miles-resident, miles-files"
        )
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(workdir, args.shape, seed=0)
    texts = prompts(args.prompts_per_step * args.steps, args.prompt_tokens, seed=1)
    data_path = workdir / "prompts.jsonl"
    data_path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts), encoding="utf-8")
    (workdir / "gpu_bench_reward.py").write_text(REWARD_MODULE, encoding="utf-8")
    spec = {
        "model_dir": str(model_dir),
        "data_path": str(data_path),
        "prompts": texts,
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "micro_batch_size": args.micro_batch_size,
        "output_dir": str(workdir / "trl_out"),
        "cpu_smoke": args.cpu_smoke,
    }
    runs = []
    for side in sides:
        print(f"== {side}", flush=True)
        if side == "trl":
            run = run_trl(spec, workdir, args.timeout)
        else:
            run = run_miles(spec, side, workdir, args.timeout)
        print(json.dumps({k: v for k, v in run.items() if k != "phases"})[:3000], flush=True)
        runs.append(run)
    summary = summarize(runs)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": args.shape,
        "setting": {k: v for k, v in spec.items() if k != "prompts"},
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
