"""Pluggy hook specifications: the points where plugins join the loop.

Named drivers (a backend, a loss, a reward...) are *selected* by name through entry
points (see ``miles.plugins``); hooks are how loaded code is *called* around them.
Every hook is prefixed ``miles_``. A plugin implements any subset with
``@miles.hookimpl`` in a module registered under the ``miles.plugins`` entry-point
group; pluggy checks the argument names at registration.

Hooks marked *driver* fire in the ``miles run`` process; hooks marked *rank* fire in
every trainer rank process (the backend builds its own plugin manager there, and calls
``miles_configure`` with the run's config before it builds anything, so a plugin's
rank hooks see the recipe's values). No hook fires in a rollout engine process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from miles.config.options import OptionSlot
    from miles.config.schema import MilesConfig
    from miles.config.sections import ConfigSection
    from miles.interfaces import CorrectionOutput, LossInputs, LossOutput, RolloutService, TransportStats
    from miles.types import Group, TrainBatch

hookspec = pluggy.HookspecMarker("miles")

# ---------------------------------------------------------------- configuration


@hookspec
def miles_config_sections() -> list[ConfigSection] | None:
    """Contribute typed config sections (driver, at start-up, before the recipe is validated).

    Return ``ConfigSection(name=..., model=SomePydanticModel)`` records; the recipe may
    then carry a top-level key ``name`` validated by ``model``. Two plugins claiming
    one section name is an error naming both. Returning None contributes nothing.
    """


@hookspec(historic=True)
def miles_configure(config: MilesConfig) -> None:
    """The validated run config (driver and rank): configure the plugin from the recipe here.

    Fires once in the driver, before any process is spawned (raise ``ConfigError`` to
    refuse the recipe), and once in every trainer rank process, before the rank builds
    its loss, correction and transport: the rank rebuilds the same validated config
    (plugin sections included) from the data the driver sent in ``BackendSpec.config``.
    So state a plugin sets here (a module global, an attribute) holds in every process
    where its hooks and components run. Keep it idempotent and free of driver-only side
    effects (a tracker opens its run in ``miles_on_run_start``, which fires once).

    Historic: a plugin registered later still receives it.
    """


@hookspec
def miles_check_config(config: MilesConfig) -> None:
    """Refuse a recipe whose components do not fit the plugin's settings (driver, before anything starts).

    Fires after the core's own checks of the selected components (``miles.capabilities.check_needs``),
    in ``miles run`` and in ``miles config validate --check``. Raise ``ConfigError`` (one sentence
    saying what to change) to refuse; load components with ``miles.plugins.load_component`` to
    read what they declare (``GenerateNeeds`` and its subclasses).
    """


@hookspec(firstresult=True)
def miles_model_directory(path: str) -> str | None:
    """Claim a model directory that is not a Hugging Face model directory (driver).

    The core's ``model.path`` check (``miles.models.registry.check_model_dir``) wants a top-level
    ``config.json`` and weight files; a plugin whose engines and backend load another layout (a
    pipeline directory of several components, say) recognises its own here. Return a short
    description of what the directory is (the directory is then accepted as it is: loading and
    checking it is the plugin's business), or None when it is not yours. The first answer wins.
    """


@hookspec
def miles_option_slots(config: MilesConfig) -> list[OptionSlot] | None:
    """The options mappings of the components a plugin's config section selects (driver).

    Return ``miles.config.options.OptionSlot`` records (where the mapping is, which components it
    configures); each is validated against its components' declared options like the core's own
    (``rollout.reward_options`` and the rest), with the recipe's file and line. None: none.
    """


@hookspec
def miles_on_run_start(config: MilesConfig, run_dir: str) -> None:
    """The run directory exists and engines are up; nothing has been trained yet (driver)."""


@hookspec
def miles_on_run_end(run_dir: str, status: str) -> None:
    """The run finished (``status`` is ``completed``, ``failed`` or ``interrupted``) (driver)."""


# ---------------------------------------------------------------------- rollout


@hookspec
def miles_rollout_services(config: MilesConfig) -> list[RolloutService] | RolloutService | None:
    """Services the run's rollout uses (driver, while the components are resolved, before any engine starts).

    Return ``RolloutService`` objects (or None when the recipe asks for none of yours): the
    driver starts each once the engines are up (``service.start(ServiceSetup)``, a context
    manager), puts what it yields in ``RolloutContext.services[service.name]`` and closes it
    when the run ends. Resolve the names your settings select here, so that a bad one fails
    before anything heavy starts. Two services with one name is an error.
    """


@hookspec
def miles_rollout_postprocess(groups: list[Group], step: int) -> None:
    """Rewarded groups of one rollout, before filtering and the buffer; mutate in place (driver).

    Use it for reward shaping or to annotate samples' ``metadata``.
    """


# ----------------------------------------------------------------------- buffer


@hookspec(firstresult=True)
def miles_buffer_reject(group: Group) -> str | None:
    """Return a reason to drop ``group`` on arrival at the buffer, or ``None`` to keep it (driver).

    Runs after the recipe's own filters. The first plugin that returns a reason wins; the
    group is discarded and reported to ``miles_on_group_dropped`` as ``"filter:<reason>"``.
    """


@hookspec
def miles_on_group_dropped(group: Group, reason: str) -> None:
    """A group left the loop without being trained on (driver); ``reason`` says why."""


# ------------------------------------------------------------------------- loss


@hookspec
def miles_advantages_postprocess(batch: TrainBatch) -> None:
    """Per-token advantages after the estimator, before the backend; mutate ``batch.advantages`` (driver).

    This is where terms that compose with every estimator (a distillation penalty,
    a length penalty) fold in.
    """


@hookspec
def miles_loss_terms(inputs: LossInputs, kind: str) -> dict[str, torch.Tensor] | None:
    """Extra loss terms for one micro-batch, added to the loss before backward (rank).

    The way to add a regulariser or penalty: return ``{name: scalar_tensor}`` (or
    ``None`` for none, e.g. when ``kind`` is not yours). Every plugin's terms are summed
    into the loss, so plugins compose; each term's value is logged as ``loss/<name>``
    (a name used twice, or one the loss already logs, is an error naming it).
    ``kind`` is the loss's kind: ``"policy"``, ``"supervised"``, or ``"value"`` for the
    critic's loss (whose ``inputs`` carry ``values``, not ``logprobs``); a plugin that
    asks only for ``inputs`` gets every kind. Like the loss, a term is this
    micro-batch's share of the global batch's term: divide sums by
    ``inputs.num_loss_tokens`` (the global trained-token count) so micro-batches and
    ranks add up to a token mean.
    """


@hookspec
def miles_loss_postprocess(output: LossOutput, inputs: LossInputs, kind: str) -> LossOutput | None:
    """The loss of one micro-batch after ``miles_loss_terms``, before backward (rank).

    A chain: implementations run one after the other (pluggy's order: LIFO registration,
    ``tryfirst`` / ``trylast`` respected) and each receives in ``output`` the result of
    the previous ones. Return a new ``LossOutput`` to replace it, or ``None`` to keep it
    (mutating ``output`` in place also works). So two plugins that each return
    ``LossOutput(output.loss + term, ...)`` both count. The backend trains on the last
    output of the chain. Use it to rescale or rewrite the loss; to *add* a term prefer
    ``miles_loss_terms``, which also logs it. ``kind`` as in ``miles_loss_terms``
    (optional, like every hook argument). Wrappers are refused for this hook: there is
    no single call for them to wrap.
    """


# ------------------------------------------------------------------- correction


@hookspec
def miles_correction_postprocess(output: CorrectionOutput, loss_mask: torch.Tensor) -> None:
    """Per-token correction weights of one micro-batch, before the loss (rank); mutate in place."""


# ---------------------------------------------------------------------- backend


@hookspec(firstresult=True)
def miles_train_step(step: int, batch: TrainBatch) -> dict[str, float] | None:
    """Run one training step on ``batch`` and return its metrics (driver).

    The run's backend implements it (the driver registers it as a plugin named
    ``backend``). Other plugins wrap it with ``@miles.hookimpl(wrapper=True)`` to
    time it, profile it or add metrics::

        @miles.hookimpl(wrapper=True)
        def miles_train_step(step, batch):
            t0 = time.perf_counter()
            metrics = yield
            return {**metrics, "perf/my_step_s": time.perf_counter() - t0}
    """


@hookspec
def miles_on_checkpoint_saved(step: int, directory: str) -> None:
    """A resumable checkpoint was fully written to ``directory`` (driver)."""


# -------------------------------------------------------------------- transport


@hookspec
def miles_on_weights_updated(version: int, stats: TransportStats) -> None:
    """Every engine now serves weight version ``version`` (driver)."""


# --------------------------------------------------------------------- tracking


@hookspec
def miles_on_metrics(step: int, metrics: dict[str, float]) -> None:
    """The metrics of one finished step (driver). Trackers (W&B, MLflow, ...) plug in here."""


@hookspec
def miles_on_eval(step: int, metrics: dict[str, float]) -> None:
    """An evaluation of the weights trained by ``step`` finished (driver), possibly several steps later.

    ``metrics`` holds ``eval/*`` (score, ``eval/delay_steps``, the version checks, ``eval/skipped``).
    Every evaluation is also a line of ``eval.jsonl`` in the run directory.
    """
