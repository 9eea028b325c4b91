"""The rich console: a bar for the run's steps, a bar for each rollout, a metrics table per step."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles import hookimpl
from miles.tracking.timing import TimeBreakdown
from miles.types import Group

# The metrics shown in the per-step table, in this order, when present.
HEADLINE = (
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/full_reward_frac",
    "rollout/response_len_mean",
    "rollout/truncated_frac",
    "rollout/groups_kept",
    "rollout/groups_dropped",
    "train/loss",
    "loss/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "loss/clipfrac",
    "correction/ratio_mean",
    "correction/clipped_frac",
    "correction/abs_dev",
    "time/rollout_s",
    "time/train_step_s",
    "time/weight_update_s",
    "time/other_s",
    "time/step_s",
    "engine/weight_version",
)


class ConsoleTracker:
    def __init__(
        self, num_steps: int, first_step: int = 0, log_samples: int = 1, console: Console | None = None
    ) -> None:
        self.console = console or Console(stderr=True)
        self.log_samples = log_samples
        self.breakdown = TimeBreakdown()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._steps = self.progress.add_task("steps", total=num_steps, completed=first_step)
        self._rollout = self.progress.add_task("rollout", total=1, visible=False)
        self.progress.start()

    def start_rollout(self, step: int, total_samples: int) -> None:
        self.progress.reset(self._rollout, total=total_samples, description=f"rollout {step}", visible=True)

    def sample_done(self, _sample: object = None) -> None:
        self.progress.advance(self._rollout)

    def show_samples(self, groups: list[Group]) -> None:
        for group in groups[: self.log_samples]:
            s = group.samples[0]
            self.console.print(
                f"[dim]prompt {s.prompt.index} label={s.prompt.label!r} "
                f"reward={s.reward}[/dim] {s.response_text[:200]!r}"
            )

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        table = Table(title=f"step {step}", show_header=True, header_style="bold", box=None)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in HEADLINE:
            if key in metrics:
                table.add_row(key, f"{metrics[key]:.4g}")
        self.console.print(table)
        self.progress.advance(self._steps)
        self.breakdown.add(metrics)

    @hookimpl
    def miles_on_run_end(self, run_dir: str, status: str) -> None:
        """Where the run's time went: every phase's total, per step, and share of the step time."""
        if not self.breakdown.steps:
            return
        table = Table(
            title=f"where the time went ({self.breakdown.steps} steps)",
            show_header=True,
            header_style="bold",
            box=None,
        )
        table.add_column("phase")
        for name in ("total s", "s/step", "share"):
            table.add_column(name, justify="right")
        for label, seconds, mean, share in self.breakdown.rows():
            table.add_row(label, f"{seconds:.2f}", f"{mean:.3f}", f"{share:.1%}")
        self.console.print(table)

    @hookimpl
    def miles_on_eval(self, step: int, metrics: dict[str, float]) -> None:
        if metrics.get("eval/skipped"):
            self.console.print(f"[yellow]eval of step {step} skipped[/yellow]")
            return
        score = metrics.get("eval/score", float("nan"))
        delay = metrics.get("eval/delay_steps", 0.0)
        self.console.print(
            f"[bold]eval[/bold] of step {step}: score {score:.4g} (arrived {delay:.0f} steps later)"
        )

    def close(self) -> None:
        self.progress.stop()
