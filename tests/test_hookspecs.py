"""Every hookspec in ``miles.hookspecs`` has a test in which a registered plugin receives it.

``HOOK_TESTS`` names, for each hookspec, the tests that check it fires at its documented
moment, with its documented arguments, and that what it returns (or mutates) is honoured.
``test_every_hookspec_has_a_test`` fails when a hookspec is added without an entry (or an
entry names a test that does not exist), so a new hook cannot ship untested.

The driver hooks are checked in one real run (``test_driver_hooks_fire_in_one_run``); the
rank hooks at the unit that calls them (a ``RankTrainer`` in ``tests/fsdp/test_rank_hooks.py``)
and, for ``miles_configure``, across the real process boundary in that same run.
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import miles.hookspecs
from miles import hookimpl
from miles.errors import ComponentError
from miles.interfaces import DROP_FILTER_PREFIX, LossInputs, LossOutput
from miles.plugins import MilesPluginManager, get_plugin_manager, reset_plugin_state

TESTS = Path(__file__).resolve().parent
RUN = "tests/test_hookspecs.py::test_driver_hooks_fire_in_one_run"
RANK = "tests/fsdp/test_rank_hooks.py"

HOOK_TESTS: dict[str, list[str]] = {
    "miles_model_directory": [
        "tests/test_hookspecs.py::test_a_plugin_claims_a_model_directory_of_its_own_layout",
        "tests/diffusion/test_sd3.py::test_the_core_path_takes_an_sd3_directory_and_refuses_another_pipeline",
    ],
    "miles_config_sections": [
        "tests/test_hookspecs.py::test_config_sections_type_a_recipe_section",
        f"{RANK}::test_rank_configures_plugins_from_the_spec_config",
    ],
    "miles_configure": [
        "tests/test_hookspecs.py::test_configure_sees_the_validated_config_and_may_refuse_it",
        f"{RANK}::test_rank_configures_plugins_from_the_spec_config",
        f"{RANK}::test_rank_refuses_a_config_its_plugins_cannot_validate",
        RUN,
    ],
    "miles_check_config": ["tests/test_plugin_services.py::test_check_config_may_refuse_a_recipe"],
    "miles_option_slots": [
        "tests/test_plugin_services.py::test_option_slots_of_a_plugin_are_validated_like_the_cores"
    ],
    "miles_rollout_services": [
        "tests/test_plugin_services.py::test_rollout_services_start_in_order_and_reach_the_rollout_context",
        "tests/test_plugin_services.py::test_two_services_with_one_name_are_refused",
    ],
    "miles_on_run_start": [RUN],
    "miles_on_run_end": [RUN],
    "miles_rollout_postprocess": [RUN],
    "miles_buffer_reject": [RUN],
    "miles_on_group_dropped": [RUN],
    "miles_advantages_postprocess": [RUN],
    "miles_loss_terms": [
        f"{RANK}::test_two_plugins_loss_terms_compose_and_are_logged",
        f"{RANK}::test_terms_are_added_before_the_postprocess_chain",
        "tests/test_hookspecs.py::test_loss_terms_refuse_clashing_names_and_non_scalars",
        RUN,
    ],
    "miles_loss_postprocess": [
        f"{RANK}::test_postprocess_replacements_chain",
        f"{RANK}::test_terms_are_added_before_the_postprocess_chain",
        "tests/test_hookspecs.py::test_loss_postprocess_refuses_wrappers_and_wrong_returns",
    ],
    "miles_correction_postprocess": [f"{RANK}::test_correction_postprocess_mutation_reaches_the_loss"],
    "miles_train_step": [RUN],
    "miles_on_checkpoint_saved": [RUN],
    "miles_on_weights_updated": [RUN],
    "miles_on_metrics": [RUN],
    "miles_on_eval": [RUN],
}


def _hookspec_names() -> set[str]:
    # pluggy's marker leaves a ``miles_spec`` attribute on every hookspec function.
    return {
        name
        for name in dir(miles.hookspecs)
        if name.startswith("miles_") and hasattr(getattr(miles.hookspecs, name), "miles_spec")
    }


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_hookspec_has_a_test() -> None:
    specs = _hookspec_names()
    assert len(specs) >= 16  # the marker attribute is what this test relies on
    assert set(HOOK_TESTS) == specs, (
        f"hookspecs without a test: {sorted(specs - set(HOOK_TESTS))}; "
        f"entries for hooks that no longer exist: {sorted(set(HOOK_TESTS) - specs)}"
    )
    for hook, node_ids in HOOK_TESTS.items():
        assert node_ids, hook
        for node_id in node_ids:
            file, name = node_id.split("::")
            path = TESTS.parent / file
            assert path.is_file(), node_id
            assert name in _test_functions(path), f"{node_id} (listed for {hook}) does not exist"
            assert hook in path.read_text(encoding="utf-8"), f"{file} never mentions {hook}"


# ------------------------------------------------------------------ configuration


class _Options:
    """The plugin's section model, built lazily so that importing this module stays light."""

    @staticmethod
    def model() -> type:
        from pydantic import BaseModel, Field

        class HookTestOptions(BaseModel):
            level: int = Field(1, ge=0)

        return HookTestOptions


class SectionPlugin:
    def __init__(self, refuse_above: int | None = None) -> None:
        self.model = _Options.model()
        self.refuse_above = refuse_above
        self.configured: list[Any] = []

    @hookimpl
    def miles_config_sections(self) -> list[Any]:
        from miles.config.sections import ConfigSection

        return [ConfigSection(name="hooktest", model=self.model, description="test section")]

    @hookimpl
    def miles_configure(self, config: Any) -> None:
        from miles.errors import ConfigError

        self.configured.append(config)
        if self.refuse_above is not None and config.hooktest.level > self.refuse_above:
            raise ConfigError(f"hooktest.level {config.hooktest.level} is above {self.refuse_above}")


@pytest.fixture
def registered():
    # A fresh manager, dropped afterwards: miles_configure is historic, so a config it received
    # here would otherwise be replayed to every plugin later tests register.
    reset_plugin_state()
    pm = get_plugin_manager()
    plugins: list[Any] = []

    def register(plugin: Any) -> Any:
        pm.register(plugin)
        plugins.append(plugin)
        return plugin

    yield register
    for plugin in plugins:
        pm.unregister(plugin)
    reset_plugin_state()


def test_config_sections_type_a_recipe_section(registered) -> None:
    from miles.config import load_recipe
    from miles.config.loader import RecipeError

    plugin = registered(SectionPlugin())
    config = load_recipe("default", ["hooktest.level=3"])
    assert isinstance(config.hooktest, plugin.model) and config.hooktest.level == 3
    assert load_recipe("default").hooktest.level == 1  # the model's default when the recipe omits it
    with pytest.raises(RecipeError, match=r"hooktest\.level"):
        load_recipe("default", ["hooktest.level=-1"])


def test_configure_sees_the_validated_config_and_may_refuse_it(registered) -> None:
    from miles.config import load_recipe
    from miles.driver.preflight import close_components, preflight
    from miles.errors import ConfigError

    plugin = registered(SectionPlugin(refuse_above=5))
    config = load_recipe("default", ["hooktest.level=7"])
    assert plugin.configured == []  # validating a recipe is not configuring a run
    with pytest.raises(ConfigError, match=r"hooktest\.level 7 is above 5"):
        preflight(config)
    assert plugin.configured[-1] is config
    ok = load_recipe("default", ["hooktest.level=2"])
    close_components(preflight(ok).components)
    assert plugin.configured[-1] is ok


# ---------------------------------------------------------------------------- loss


def _bare_pm(*plugins: Any) -> MilesPluginManager:
    """A manager with only ``plugins``: the loss-hook rules, without the installed plugins."""
    pm = MilesPluginManager()
    pm.add_hookspecs(miles.hookspecs)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def _loss() -> tuple[LossOutput, LossInputs]:
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(loss_mask=torch.ones(1, 2), logprobs=logprobs, num_loss_tokens=2)
    return LossOutput(loss=-logprobs.sum() / 2, metrics={"pg_loss": 1.5}), inputs


def test_loss_terms_refuse_clashing_names_and_non_scalars() -> None:
    from miles._plugins.backend_hooks import apply_loss_hooks

    class Term:
        def __init__(self, terms: Any) -> None:
            self.terms = terms

        @hookimpl
        def miles_loss_terms(self, inputs: LossInputs) -> Any:
            return self.terms

    output, inputs = _loss()
    out = apply_loss_hooks(_bare_pm(Term({"a": torch.tensor(0.5)}), Term(None)), output, inputs, "policy")
    assert float(out.loss.detach()) == pytest.approx(2.0) and out.metrics == {"pg_loss": 1.5, "a": 0.5}
    assert output.metrics == {"pg_loss": 1.5}  # the loss's own output is left as it was
    with pytest.raises(ComponentError, match=r"loss term 'a' of plugin .* is already logged by plugin"):
        apply_loss_hooks(
            _bare_pm(Term({"a": torch.tensor(1.0)}), Term({"a": torch.tensor(2.0)})), *_loss(), "policy"
        )
    with pytest.raises(ComponentError, match=r"'pg_loss' .* already logged by the loss itself"):
        apply_loss_hooks(_bare_pm(Term({"pg_loss": torch.tensor(1.0)})), *_loss(), "policy")
    with pytest.raises(ComponentError, match="must be a scalar tensor"):
        apply_loss_hooks(_bare_pm(Term({"a": torch.ones(2)})), *_loss(), "policy")
    with pytest.raises(ComponentError, match=r"expected \{name: tensor\}"):
        apply_loss_hooks(_bare_pm(Term([torch.tensor(1.0)])), *_loss(), "policy")


def test_loss_postprocess_refuses_wrappers_and_wrong_returns() -> None:
    from miles._plugins.backend_hooks import apply_loss_hooks

    class Wrapper:
        @hookimpl(wrapper=True)
        def miles_loss_postprocess(self, output: LossOutput) -> Any:
            return (yield)

    class Wrong:
        @hookimpl
        def miles_loss_postprocess(self, output: LossOutput) -> Any:
            return output.loss

    with pytest.raises(ComponentError, match="wrap miles_loss_postprocess"):
        apply_loss_hooks(_bare_pm(Wrapper()), *_loss(), "policy")
    with pytest.raises(ComponentError, match="returned Tensor from miles_loss_postprocess"):
        apply_loss_hooks(_bare_pm(Wrong()), *_loss(), "policy")


# ---------------------------------------------------------------- one real run

FIXTURE_MODULE = """
    '''An installed hook plugin: its own section, configured in miles_configure, read in the rank's loss term.'''
    from pydantic import BaseModel

    from miles import hookimpl
    from miles.config.sections import ConfigSection


    class Options(BaseModel):
        weight: float = 0.0


    weight = Options().weight


    @hookimpl
    def miles_config_sections():
        return [ConfigSection(name="hookspec_fixture", model=Options)]


    @hookimpl
    def miles_configure(config):
        global weight
        weight = config.hookspec_fixture.weight


    @hookimpl
    def miles_loss_terms(inputs, kind):
        # The micro-batch's share of the trained tokens, so the term sums to `weight` per step.
        return {"fixture_term": weight * inputs.loss_mask.sum() / inputs.num_loss_tokens}
"""


class DriverRecorder:
    """Implements every driver hook; records what it saw and changes what it may change."""

    REASON = "hookspec test: the first group"

    def __init__(self) -> None:
        self.events: list[str] = []
        self.configured: list[float] = []
        self.run_start: list[tuple[Any, bool, bool]] = []
        self.rollout_steps: list[int] = []
        self.rejected: list[int] = []
        self.dropped: list[tuple[int, str]] = []
        self.trained: dict[int, list[int]] = {}
        self.marked: dict[int, bool] = {}
        self.train_steps: list[int] = []
        self.checkpoints: list[tuple[int, bool]] = []
        self.versions: list[tuple[int, int]] = []
        self.metrics: dict[int, dict[str, float]] = {}
        self.evals: list[tuple[int, dict[str, float]]] = []
        self.run_end: list[tuple[str, str]] = []

    @hookimpl
    def miles_configure(self, config: Any) -> None:
        self.configured.append(config.hookspec_fixture.weight)

    @hookimpl
    def miles_on_run_start(self, config: Any, run_dir: str) -> None:
        self.events.append("run_start")
        metrics = os.path.join(run_dir, "metrics.jsonl")
        nothing_trained = not os.path.exists(metrics) or os.path.getsize(metrics) == 0
        self.run_start.append((config.hookspec_fixture.weight, os.path.isdir(run_dir), nothing_trained))

    @hookimpl
    def miles_rollout_postprocess(self, groups: list[Any], step: int) -> None:
        self.events.append("rollout")
        self.rollout_steps.append(step)
        for group in groups:
            for sample in group.samples:
                sample.metadata["hookspec_step"] = step  # a mutation the trained batch must carry

    @hookimpl
    def miles_buffer_reject(self, group: Any) -> str | None:
        if self.rejected:
            return None
        self.rejected.append(group.prompt.index)
        return self.REASON

    @hookimpl
    def miles_on_group_dropped(self, group: Any, reason: str) -> None:
        self.dropped.append((group.prompt.index, reason))

    @hookimpl
    def miles_advantages_postprocess(self, batch: Any) -> None:
        self.trained[batch.step] = sorted({s.prompt.index for s in batch.samples})
        self.marked[batch.step] = all(s.metadata.get("hookspec_step") == batch.step for s in batch.samples)
        for row in batch.advantages:
            row[:] = [0.0] * len(row)  # zero advantages: the policy-gradient loss becomes exactly 0

    @hookimpl(wrapper=True)
    def miles_train_step(self, step: int, batch: Any) -> Any:
        self.events.append("train")
        self.train_steps.append(step)
        metrics = yield
        return {**metrics, "hookspec/train_step": float(step)}

    @hookimpl
    def miles_on_checkpoint_saved(self, step: int, directory: str) -> None:
        self.checkpoints.append((step, os.path.isdir(directory) and bool(os.listdir(directory))))

    @hookimpl
    def miles_on_weights_updated(self, version: int, stats: Any) -> None:
        self.versions.append((version, stats.version))

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append("metrics")
        self.metrics[step] = dict(metrics)

    @hookimpl
    def miles_on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append("eval")
        self.evals.append((step, dict(metrics)))

    @hookimpl
    def miles_on_run_end(self, run_dir: str, status: str) -> None:
        self.events.append("run_end")
        self.run_end.append((run_dir, status))


@pytest.mark.slow
def test_driver_hooks_fire_in_one_run(fake_site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.config import load_recipe
    from miles.loop import train

    # A real installed distribution: the rank process (spawned, with a fresh plugin manager) finds
    # it through its entry point, as it would find any installed plugin.
    fake_site.module("hookspec_fixture", textwrap.dedent(FIXTURE_MODULE))
    fake_site.dist(
        "miles-hookspec-fixture", "0.1.0", {"miles.plugins": {"hookspec_fixture": "hookspec_fixture"}}
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(fake_site.root), os.environ.get("PYTHONPATH")]))
    )
    config = load_recipe(
        "default",
        [
            f"run.output_dir={tmp_path}",
            "warm_start=null",
            "eval=null",
            # The RL settings these tests were written for (the default recipe's before its warm start).
            "rollout.reward=numeric_closeness",
            "train.lr=0.01",
            "run.num_steps=2",
            "run.save_every=1",
            "run.export_hf=false",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.filters=[]",
            "tracking.console=false",
            "eval.data.source=jsonl",
            "eval.data.path=builtin:arith",
            "eval.every=1",
            "eval.max_prompts=4",
            "hookspec_fixture.weight=0.25",
        ],
    )
    rec = DriverRecorder()
    pm = get_plugin_manager()
    pm.register(rec)
    try:
        result = train(config)
    finally:
        pm.unregister(rec)

    assert rec.configured == [0.25]
    assert rec.run_start == [(0.25, True, True)]
    assert rec.events[0] == "run_start" and rec.events[-1] == "run_end"
    assert rec.run_end == [(result.run_dir, "completed")]
    assert rec.rollout_steps == [0, 1] and rec.train_steps == [0, 1]
    # The first group was rejected on arrival, reported as dropped with the plugin's reason, and not trained.
    [first] = rec.rejected
    assert rec.dropped == [(first, DROP_FILTER_PREFIX + DriverRecorder.REASON)]
    assert first not in rec.trained[0] and len(rec.trained[0]) == 3 and len(rec.trained[1]) == 4
    assert rec.marked == {0: True, 1: True}
    assert [s for s, ok in rec.checkpoints if ok] == [s for s, _ in rec.checkpoints] and {0, 1} <= {
        s for s, _ in rec.checkpoints
    }
    assert rec.versions == [(1, 1), (2, 2)]
    assert rec.evals and all(k.startswith("eval/") for _, m in rec.evals for k in m)
    assert {s for s, _ in rec.evals} <= {0, 1}

    with open(result.metrics_path, encoding="utf-8") as f:
        rows = {row["step"]: row for row in map(json.loads, f)}
    for step in (0, 1):
        row, seen = rows[step], rec.metrics[step]
        assert row["hookspec/train_step"] == seen["hookspec/train_step"] == step  # the wrapper's metric
        # Inside the rank: the recipe's weight (0.25, not the default 0.0), the only loss left
        # once the advantages are zero.
        assert row["loss/fixture_term"] == pytest.approx(0.25)
        assert row["train/loss"] == pytest.approx(0.25, abs=1e-6)


class DirectoryPlugin:
    """Claims directories holding a ``layout.json`` (a layout of its own, no top-level config.json)."""

    @hookimpl
    def miles_model_directory(self, path: str) -> str | None:
        return "a two-part layout" if (Path(path) / "layout.json").is_file() else None


def test_a_plugin_claims_a_model_directory_of_its_own_layout(registered, tmp_path: Path) -> None:
    from miles.errors import ModelError
    from miles.models.registry import check_model_dir, claimed_directory, resolve_model

    own = tmp_path / "own"
    (own / "part").mkdir(parents=True)
    (own / "layout.json").write_text("{}")
    with pytest.raises(ModelError, match=r"missing config\.json"):
        check_model_dir(own)
    registered(DirectoryPlugin())
    assert claimed_directory(own) == "a two-part layout"
    assert check_model_dir(own) == own.resolve() and resolve_model(str(own)) == str(own.resolve())
    other = tmp_path / "other"
    other.mkdir()
    assert claimed_directory(other) is None
    with pytest.raises(ModelError, match=r"missing config\.json"):
        check_model_dir(other)
