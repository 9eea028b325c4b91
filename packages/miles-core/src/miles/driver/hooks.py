"""The driver's typed calls of the ``miles_*`` hooks (their specs and docs: ``miles.hookspecs``).

``pm.hook`` takes any keyword arguments and returns ``Any``; ``Hooks`` gives each driver hook its
signature, so the type checker sees what the driver passes and gets back. The methods keep the
hooks' names and keyword-only arguments: ``hooks.miles_on_metrics(step=..., metrics=...)`` reads
the same through the facade as through ``pm.hook``. Rank hooks (loss terms, loss and correction
postprocessing) are called by the backend through ``miles._plugins.backend_hooks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pluggy

    from miles.config.schema import MilesConfig
    from miles.interfaces import TransportStats
    from miles.types import Group, TrainBatch


class Hooks:
    """The driver hooks of one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._hook = pm.hook

    # ------------------------------------------------------------ configuration

    def miles_configure(self, *, config: MilesConfig) -> None:
        """Historic: a plugin registered later still receives the config."""
        self._hook.miles_configure.call_historic(kwargs={"config": config})

    def miles_on_run_start(self, *, config: MilesConfig, run_dir: str) -> None:
        self._hook.miles_on_run_start(config=config, run_dir=run_dir)

    def miles_on_run_end(self, *, run_dir: str, status: str) -> None:
        self._hook.miles_on_run_end(run_dir=run_dir, status=status)

    # ------------------------------------------------------------ rollout and buffer

    def miles_rollout_postprocess(self, *, groups: list[Group], step: int) -> None:
        self._hook.miles_rollout_postprocess(groups=groups, step=step)

    def miles_buffer_reject(self, *, group: Group) -> str | None:
        return self._hook.miles_buffer_reject(group=group)

    def miles_on_group_dropped(self, *, group: Group, reason: str) -> None:
        self._hook.miles_on_group_dropped(group=group, reason=reason)

    # ------------------------------------------------------------ training

    def miles_advantages_postprocess(self, *, batch: TrainBatch) -> None:
        self._hook.miles_advantages_postprocess(batch=batch)

    def miles_train_step(self, *, step: int, batch: TrainBatch) -> dict[str, float] | None:
        return self._hook.miles_train_step(step=step, batch=batch)

    def miles_on_checkpoint_saved(self, *, step: int, directory: str) -> None:
        self._hook.miles_on_checkpoint_saved(step=step, directory=directory)

    def miles_on_weights_updated(self, *, version: int, stats: TransportStats) -> None:
        self._hook.miles_on_weights_updated(version=version, stats=stats)

    # ------------------------------------------------------------ tracking

    def miles_on_metrics(self, *, step: int, metrics: dict[str, float]) -> None:
        self._hook.miles_on_metrics(step=step, metrics=metrics)

    def miles_on_eval(self, *, step: int, metrics: dict[str, float]) -> None:
        self._hook.miles_on_eval(step=step, metrics=metrics)
