"""``miles replay``: look at a rollout dump (``rollout.dump: true``) again, without engines.

``miles replay reward DUMP --reward NAME`` re-scores the dumped samples with another reward;
``miles replay logprobs DUMP --step N`` recomputes the trainer's log-probs of a dumped step
with an HF model and reports where train and rollout log-probs first diverge;
``miles replay train DUMP --step N`` trains once on a dumped step (no engines).
"""

from __future__ import annotations

import json
import os

import click

from miles.cli._common import verbose_option


@click.group()
def replay() -> None:
    """Replay a rollout dump: re-score it, or compare its log-probs.

    Or train once on one of its steps, without engines (replay train).
    """


def _options(text: str | None) -> dict[str, object]:
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--reward-options")
    return value


@replay.command()
@click.argument("dump", type=click.Path(exists=True))
@click.option("--reward", required=True, help="reward name or import path (pkg.module:fn)")
@click.option("--reward-options", help='the reward\'s options as JSON ({"scale": 5})')
@click.option("--step", type=int, help="only this step (default: every step in the dump)")
@click.option("--out", type=click.Path(dir_okay=False), help="write the dump with the new rewards here")
@verbose_option
def reward(dump: str, reward: str, reward_options: str | None, step: int | None, out: str | None) -> None:
    """Re-score DUMP (a dump file, a run directory or its rollouts/) with REWARD."""
    from miles.tracking.replay import load_records, rescore, write_jsonl

    records = load_records(dump, step)
    result = rescore(records, reward, _options(reward_options))
    old = [v for v in result.old if v is not None]
    click.echo(
        f"{len(records)} samples: mean reward {sum(old) / max(len(old), 1):.4f} as dumped, "
        f"{sum(result.new) / max(len(result.new), 1):.4f} with {reward}; {result.changed} changed"
    )
    if out:
        rows = [
            {**r, "dumped_reward": r.get("reward"), "reward": v}
            for r, v in zip(records, result.new, strict=True)
        ]
        write_jsonl(out, rows)
        click.echo(f"written: {out}")


@replay.command()
@click.argument("dump", type=click.Path(exists=True))
@click.option("--step", type=int, required=True, help="the dumped step to compare")
@click.option("--model", help="HF model dir or builtin:NAME (default: the run's final/)")
@click.option(
    "--temperature", type=float, help="sampling temperature (default: the run's rollout.temperature)"
)
@click.option(
    "--tolerance", type=float, default=1e-3, show_default=True, help="a larger |diff| is a divergence"
)
@click.option(
    "--top", type=int, default=10, show_default=True, help="samples listed, largest difference first"
)
@click.option("--out", type=click.Path(dir_okay=False), help="write every sample's comparison as JSON lines")
@verbose_option
def logprobs(
    dump: str,
    step: int,
    model: str | None,
    temperature: float | None,
    tolerance: float,
    top: int,
    out: str | None,
) -> None:
    """Recompute step STEP's log-probs with an HF model; report where train and rollout diverge.

    Use the weights the step was generated with (the checkpoint before it, or model.path for
    step 0) to measure engine/trainer mismatch; other weights measure the policy's drift.
    """
    from miles.models.registry import resolve_model
    from miles.tracking.replay import (
        compare_logprobs,
        load_records,
        mismatch_summary,
        recompute_logprobs,
        run_dir_of,
        write_jsonl,
    )

    records = load_records(dump, step)
    run_dir = run_dir_of(dump)
    config = _run_config(run_dir)
    if model is None:
        if run_dir is None or not os.path.isdir(os.path.join(run_dir, "final")):
            raise click.UsageError("no final/ next to the dump: give --model")
        model = os.path.join(run_dir, "final")
    if temperature is None:
        rollout = config.get("rollout", {})
        value = rollout.get("temperature", 1.0) if isinstance(rollout, dict) else 1.0
        temperature = float(value) if isinstance(value, int | float) else 1.0
    train = recompute_logprobs(resolve_model(model), records, temperature)
    rows = compare_logprobs(records, train, tolerance)
    summary = mismatch_summary(rows)
    click.echo(
        f"step {step}, {summary['samples']} samples, model {model}, temperature {temperature}: "
        f"{summary['diverged']} diverge (|diff| > {tolerance}); max |diff| {summary['max_abs_diff']:.3g}, "
        f"mean |diff| {summary['mean_abs_diff']:.3g}"
    )
    click.echo(
        f"{'prompt':>6} {'sample':>6} {'tokens':>6} {'first div':>9} {'max |diff|':>10} {'at':>4} {'mean':>9}"
    )
    for r in sorted(rows, key=lambda r: -r.max_abs_diff)[:top]:
        first = "-" if r.first_divergence is None else str(r.first_divergence)
        at = "-" if r.max_position is None else str(r.max_position)
        click.echo(
            f"{r.prompt_index:>6} {r.group_index:>6} {r.tokens:>6} {first:>9} {r.max_abs_diff:>10.3g} {at:>4} "
            f"{r.mean_abs_diff:>9.3g}"
        )
    if out:
        write_jsonl(out, [r.as_dict() for r in rows])
        click.echo(f"written: {out}")


def _run_config(run_dir: str | None) -> dict[str, object]:
    if run_dir is None:
        return {}
    import yaml

    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}


@replay.command()
@click.argument("dump", type=click.Path(exists=True))
@click.option("--step", type=int, required=True, help="the dumped step to train on")
@click.option("--model", help="weights to start from (default: the recipe's model.path)")
@click.option(
    "--set", "overrides", multiple=True, help="recipe override KEY=VALUE (e.g. algorithm.loss=gspo)"
)
@verbose_option
def train(dump: str, step: int, model: str | None, overrides: tuple[str, ...]) -> None:
    """Run one training step on dumped step STEP's samples, without engines.

    The run's config.yaml builds the trainer and objective; the metrics are printed beside the
    ones the run logged for that step. From the weights the step was trained from (model.path
    for step 0) with the same recipe, they are the run's.
    """
    from miles.tracking.curves import read_rows
    from miles.tracking.replay import load_records, run_dir_of
    from miles.tracking.replay_train import replay_train_step

    run_dir = run_dir_of(dump)
    if run_dir is None:
        raise click.UsageError(f"{dump} is not inside a run directory (no config.yaml above it)")
    metrics = replay_train_step(run_dir, load_records(dump, step), step, model, overrides)
    logged_path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_rows(logged_path) if os.path.isfile(logged_path) else []
    logged = next((r for r in rows if r.get("step") == step), {})
    click.echo(f"{'metric':<32}{'replayed':>14}{'logged':>14}")
    for key in sorted(k for k in metrics if not k.startswith("time/")):
        was = logged.get(key)
        shown = f"{was:.6g}" if isinstance(was, int | float) else "-"
        click.echo(f"{key:<32}{metrics[key]:>14.6g}{shown:>14}")
