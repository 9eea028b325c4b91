"""The rich console: a bar for the run's steps, a bar for each rollout, a metrics table per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles.tracking.base import NoOptions, TrackerContext
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
    """Also the rollout's progress bar and sample printer: the run asks the tracker named ``console``."""

    Options = NoOptions
    requires: ClassVar[tuple[str, ...]] = ()
    install: ClassVar[str] = ""

    def __init__(
        self, ctx: TrackerContext, options: NoOptions | None = None, console: Console | None = None
    ) -> None:
        self.console = console or Console(stderr=True)
        self.log_samples = ctx.log_samples
        self.breakdown = TimeBreakdown()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._steps = self.progress.add_task("steps", total=ctx.num_steps, completed=ctx.first_step)
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

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        table = Table(title=f"step {step}", show_header=True, header_style="bold", box=None)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in HEADLINE:
            if key in metrics:
                table.add_row(key, f"{metrics[key]:.4g}")
        self.console.print(table)
        self.progress.advance(self._steps)
        self.breakdown.add(metrics)

    def close(self, status: str) -> None:
        self.progress.stop()
        self._print_breakdown()

    def _print_breakdown(self) -> None:
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

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        if metrics.get("eval/skipped"):
            self.console.print(f"[yellow]eval of step {step} skipped[/yellow]")
            return
        score = metrics.get("eval/score", float("nan"))
        delay = metrics.get("eval/delay_steps", 0.0)
        self.console.print(
            f"[bold]eval[/bold] of step {step}: score {score:.4g} (arrived {delay:.0f} steps later)"
        )
