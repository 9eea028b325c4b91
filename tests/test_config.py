"""Recipe loading: finding recipes, overrides, plugin sections, and one clear sentence per problem."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pydantic import BaseModel

from miles.config import (
    ConfigSection,
    MilesConfig,
    RecipeError,
    component_refs,
    config_json_schema,
    config_model,
    dump_config,
    list_recipes,
    load_recipe,
    validate_components,
)
from miles.config.overrides import apply_overrides, parse_override
from miles.config.yaml_io import parse_value
from miles.errors import ComponentError, ConfigError
from miles.plugins import build_plugin_manager, collect_config_sections

if TYPE_CHECKING:
    from plugin_fixtures import FakeSite


RECIPES = Path(__file__).parent / "data" / "recipes"
TINY = str(RECIPES / "tiny.yaml")


# The plugin sections tested here are the example plugin's (tests/plugins/miles-example-plugin).
pytestmark = pytest.mark.usefixtures("fixture_plugins_for_module")


@pytest.fixture(scope="module")
def pm(fixture_plugins_for_module):
    return build_plugin_manager(strict=False, disabled=["broken"])


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _problem(recipe: str, overrides: list[str], pm) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, overrides, pm=pm)
    return str(info.value)


# ------------------------------------------------------------------------- finding recipes


def test_load_a_recipe_file(pm) -> None:
    config = load_recipe(TINY, pm=pm)
    assert isinstance(config, MilesConfig)
    assert config.recipe == str(Path(TINY).resolve())
    assert (config.run.name, config.rollout.temperature, config.rollout.n_samples_per_prompt) == (
        "tiny",
        0.7,
        4,
    )
    assert config.rollout.reward == "math"  # schema default
    assert config.example.target_length == 8  # the example plugin's section, defaulted


def test_load_by_name_from_the_recipe_path(monkeypatch: pytest.MonkeyPatch, pm) -> None:
    monkeypatch.setenv("MILES_RECIPE_PATH", str(RECIPES))
    assert load_recipe("tiny", pm=pm).recipe == "tiny"
    infos = {info.name: info for info in list_recipes()}
    assert (
        infos["tiny"].description
        == "Tiny test recipe: only the required keys and a few overrides of the defaults."
    )
    assert infos["tiny"].location == str(RECIPES)
    assert infos["default"].location == "built-in"


def test_builtin_default_recipe_loads(pm) -> None:
    assert load_recipe("default", pm=pm).recipe == "default"


def test_unknown_recipe_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_RECIPE_PATH", str(RECIPES))
    with pytest.raises(
        ConfigError, match=r"^no recipe named 'tinny'; did you mean 'tiny'\? Available: .*tiny"
    ):
        load_recipe("tinny")
    with pytest.raises(ConfigError, match=r"^recipe file 'nowhere/recipe.yaml' does not exist$"):
        load_recipe("nowhere/recipe.yaml")


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("0.5", 0.5),
        ("1e-5", 1e-5),
        ("3", 3),
        ("true", True),
        ("null", None),
        ("", None),
        ("[]", []),
        ("[a, 2]", ["a", 2]),
        ("{k: 1}", {"k": 1}),
        ("'007'", "007"),
        ("2024-01-01", "2024-01-01"),
        ("Q: {prompt} #1", "Q: {prompt} #1"),
        ("a=b", "a=b"),
    ],
)
def test_override_values_are_yaml(raw: str, value: object) -> None:
    assert parse_value(raw) == value
    assert type(parse_value(raw)) is type(value)


def test_override_parsing_errors() -> None:
    with pytest.raises(ConfigError, match=r"^--set 'rollout\.temperature': expected KEY=VALUE"):
        parse_override("rollout.temperature")
    with pytest.raises(ConfigError, match=r"^--set 'rollout\.\.x=1': 'rollout\.\.x' has an empty part"):
        parse_override("rollout..x=1")
    with pytest.raises(ConfigError, match=r"^--set 'rollout\.filters=\[a': value '\[a' is not valid YAML"):
        parse_override("rollout.filters=[a")
    with pytest.raises(ConfigError, match=r"'model\.path' is a value \(str 'x'\), not a section"):
        apply_overrides({"model": {"path": "x"}}, [parse_override("model.path.sub=1")])


def test_overrides_apply(pm) -> None:
    config = load_recipe(
        TINY,
        [
            "rollout.filters=[]",
            "algorithm.correction=null",
            "train.lr=1e-5",
            "rollout.options.tools=[calc]",
            "example.target_length=12",
            "data.prompt_template=Q: {prompt} #1",
            "engine.device=cuda:0",
        ],
        pm=pm,
    )
    assert config.rollout.filters == []
    assert config.algorithm.correction is None
    assert config.train.lr == 1e-5
    assert config.rollout.options == {"tools": ["calc"]}
    assert config.example.target_length == 12
    assert config.data.prompt_template == "Q: {prompt} #1"
    assert config.engine.device == "cuda:0"


# ------------------------------------------------------------------------ error messages


def test_unknown_override_key_suggests_the_field(pm) -> None:
    assert _problem(TINY, ["rollout.temprature=0.5"], pm) == (
        f"recipe {TINY}: unknown key 'rollout.temprature' (--set rollout.temprature=0.5); "
        "did you mean 'rollout.temperature'?"
    )
    assert _problem(TINY, ["rolout.temperature=0.5"], pm).endswith(
        "unknown key 'rolout' (--set rolout.temperature=0.5); did you mean 'rollout'?"
    )
    assert _problem(TINY, ["example.target_lenght=3"], pm).endswith("did you mean 'example.target_length'?")


def test_unknown_key_without_a_close_match_lists_the_allowed_keys(pm) -> None:
    message = _problem(TINY, ["train.zzz=1"], pm)
    assert message.endswith(
        "unknown key 'train.zzz' (--set train.zzz=1); allowed in train: lr, weight_decay, betas, eps, grad_clip, "
        "micro_batch_size, warmup_steps, steps_per_rollout, lr_schedule, lr_decay_steps, min_lr_ratio, "
        "use_rollout_routing_replay"
    )


def test_unknown_key_in_a_file_names_its_line(tmp_path: Path, pm) -> None:
    path = _write(
        tmp_path,
        "model:\n  path: m\ndata:\n  path: d\nrollout:\n  n_samples_per_prompt: 4\n  temprature: 0.5\n",
    )
    assert _problem(path, [], pm) == (
        f"recipe {path}: unknown key 'rollout.temprature' ({path}:7); did you mean 'rollout.temperature'?"
    )


def test_literal_values_show_the_choices(pm) -> None:
    assert _problem(TINY, ["model.dtype=fp32"], pm).endswith(
        "model.dtype (--set model.dtype=fp32): got 'fp32'; allowed: 'float32', 'bfloat16' or 'float16'"
    )


def test_out_of_range_value(tmp_path: Path, pm) -> None:
    path = _write(tmp_path, "model:\n  path: m\ndata:\n  path: d\nrollout:\n  prompts_per_step: 0\n")
    assert _problem(path, [], pm) == (
        f"recipe {path}: rollout.prompts_per_step ({path}:6): got 0; must be greater than or equal to 1"
    )
    assert _problem(TINY, ["example.target_length=0"], pm).endswith(
        "example.target_length (--set example.target_length=0): got 0; must be greater than or equal to 1"
    )


def test_missing_required_key(tmp_path: Path, pm) -> None:
    path = _write(tmp_path, "model:\n  dtype: float32\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, pm=pm)
    assert info.value.problems == [
        f"missing required key 'model.path' ({path}:1) (a Hugging Face model directory, or builtin:NAME "
        "(see `miles models list`))",
        "missing required key 'data'",
    ]


def test_a_filter_declares_the_group_size_it_needs(pm) -> None:
    from miles.capabilities import check_needs

    with pytest.raises(ConfigError) as info:
        check_needs(load_recipe(TINY, ["rollout.n_samples_per_prompt=1"], pm=pm))
    assert str(info.value) == (
        "rollout.filters contains 'nonzero_std', which needs groups of at least 2 samples, but "
        "rollout.n_samples_per_prompt is 1: every group would be dropped; raise n_samples_per_prompt or "
        "remove the filter"
    )


def test_every_problem_is_reported(pm) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["run.nme=x", "model.path=null", "train.betas=[0.9, x]"], pm=pm)
    assert info.value.problems == [
        "unknown key 'run.nme' (--set run.nme=x); did you mean 'run.name'?",
        "model.path (--set model.path=null): got None; must be a valid string",
        "train.betas.1 (--set train.betas=[0.9, x]): got 'x'; must be a valid number, unable to parse string as a number",
    ]
    assert str(info.value).startswith(f"recipe {TINY} has 3 problems:\n  - unknown key 'run.nme'")


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\n data: [\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:2: malformed YAML: expected <block end>"):
        load_recipe(path)
    path = _write(tmp_path, "model:\n  path: m\nmodel:\n  path: n\n", "dup.yaml")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}:3:1: malformed YAML: found duplicate key 'model' \(first set on line 1\)",
    ):
        load_recipe(path)
    path = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"a recipe is a mapping of sections .* got a list$"):
        load_recipe(path)


# ------------------------------------------------------------------------ plugin sections


class _Needs(BaseModel):
    token: str


def test_plugin_sections_extend_the_root_model() -> None:
    model = config_model({"needs": ConfigSection(name="needs", model=_Needs)})
    base = {"model": {"path": "m"}, "data": {"path": "d"}}
    # a section with required keys is optional, so installing a plugin never breaks other recipes
    assert model.model_validate(base).needs is None
    assert model.model_validate({**base, "needs": {"token": "t"}}).needs == _Needs(token="t")
    assert issubclass(model, MilesConfig)
    assert config_model({}) is MilesConfig


def test_duplicate_section_names_name_both_distributions(fake_site: FakeSite) -> None:
    hooks = """
    from pydantic import BaseModel
    from miles import hookimpl
    from miles.config.sections import ConfigSection

    class Options(BaseModel):
        level: int = 1

    @hookimpl
    def miles_config_sections():
        return [ConfigSection(name="shared", model=Options)]
    """
    fake_site.module("fake_sections_a", hooks)
    fake_site.module("fake_sections_b", hooks)
    fake_site.dist("miles-fake-a", "1.0", {"miles.plugins": {"sec_a": "fake_sections_a"}})
    fake_site.dist("miles-fake-b", "2.0", {"miles.plugins": {"sec_b": "fake_sections_b"}})
    pm = build_plugin_manager(strict=False, disabled=["broken"])
    with pytest.raises(ComponentError) as info:
        collect_config_sections(pm)
    message = str(info.value)
    assert message.startswith("config section 'shared' is claimed twice: by plugin 'sec_")
    assert "(miles-fake-a 1.0)" in message and "(miles-fake-b 2.0)" in message


def test_a_plugin_cannot_take_a_builtin_section(fake_site: FakeSite) -> None:
    fake_site.module(
        "fake_takes_rollout",
        """
        from pydantic import BaseModel
        from miles import hookimpl
        from miles.config.sections import ConfigSection

        @hookimpl
        def miles_config_sections():
            return [ConfigSection(name="rollout", model=BaseModel)]
        """,
    )
    fake_site.dist("miles-fake-grabby", "0.1", {"miles.plugins": {"grabby": "fake_takes_rollout"}})
    pm = build_plugin_manager(strict=False, disabled=["broken"])
    with pytest.raises(
        ComponentError,
        match=r"^plugin 'grabby' \(miles-fake-grabby 0.1\) claims config section 'rollout', which is built into miles$",
    ):
        collect_config_sections(pm)


def test_json_schema_includes_plugin_sections(pm) -> None:
    schema = config_json_schema(pm)
    assert schema["title"] == "MilesConfig"
    assert {"rollout", "example", "model"} <= set(schema["properties"])


# ------------------------------------------------------------------------------ dumping


def test_dump_round_trips(tmp_path: Path, pm) -> None:
    config = load_recipe(TINY, ["train.lr=1e-5", "example.target_length=5"], pm=pm)
    text = dump_config(config)
    assert text.startswith(f"recipe: {config.recipe}\n")
    again = load_recipe(_write(tmp_path, text), pm=pm)
    assert again.model_dump(exclude={"recipe"}) == config.model_dump(exclude={"recipe"})


# --------------------------------------------------------------------------- components


COMPONENTS = """
class Backend: ...
class Transport: ...
class Buffer: ...
class Source: ...
class Launcher: ...
async def rollout(ctx, prompts): return []
async def generate(ctx, sample): return sample
def keep(group): return True
def advantage(groups): return []
"""

ALL_BY_PATH = [
    "backend=fake_components:Backend",
    "transport=fake_components:Transport",
    "rollout.fn=fake_components:rollout",
    "rollout.generate_fn=fake_components:generate",
    "rollout.reward=length_penalty",
    "rollout.filters=[fake_components:keep]",
    "rollout.buffer=fake_components:Buffer",
    "algorithm.advantage=fake_components:advantage",
    "algorithm.loss=reinforce",
    "algorithm.correction=null",
    "data.source=fake_components:Source",
    "engine.launcher=fake_components:Launcher",
]


def test_component_refs_cover_every_component_key(pm) -> None:
    config = load_recipe(
        TINY,
        [
            "rollout.filters=[a, b]",
            "rollout.reward_postprocess=[c]",
            "algorithm.loss=d",
            "algorithm.critic={}",
        ],
        pm=pm,
    )
    assert [key for key, _, _ in component_refs(config)] == [
        "backend",
        "transport",
        "rollout.fn",
        "rollout.generate_fn",
        "rollout.reward",
        "rollout.filters[0]",
        "rollout.filters[1]",
        "rollout.reward_postprocess[0]",
        "rollout.buffer",
        "algorithm.advantage",
        "algorithm.loss",
        "algorithm.correction",
        "algorithm.critic.loss",
        "data.source",
        "engine.launcher",
    ]


def test_validate_components_accepts_names_and_import_paths(fake_site: FakeSite, pm) -> None:
    fake_site.module("fake_components", COMPONENTS)
    config = load_recipe(TINY, ALL_BY_PATH, pm=pm)
    validate_components(config)
    assert not fake_site.imported("fake_components")  # found, not imported
    validate_components(config, load=True)
    assert fake_site.imported("fake_components")


def test_validate_components_reports_every_bad_reference(fake_site: FakeSite, pm) -> None:
    fake_site.module("fake_components", COMPONENTS)
    config = load_recipe(
        TINY, [*ALL_BY_PATH, "rollout.reward=lenght_penalty", "algorithm.loss=fake_components.Loss"], pm=pm
    )
    with pytest.raises(ComponentError) as info:
        validate_components(config)
    lines = str(info.value).splitlines()
    assert lines[0] == "2 component problems:"
    assert lines[1].startswith(
        "  - rollout.reward: no reward named 'lenght_penalty'; did you mean 'length_penalty'?"
    )
    assert lines[2].startswith("  - algorithm.loss: loss 'fake_components.Loss' is not an installed name")


def test_a_selected_broken_plugin_fails_when_loaded(fake_site: FakeSite, pm) -> None:
    fake_site.module("fake_components", COMPONENTS)
    config = load_recipe(TINY, [*ALL_BY_PATH, "rollout.reward=broken_reward"], pm=pm)
    with pytest.raises(ComponentError) as info:
        validate_components(config, load=True)
    assert str(info.value) == (
        "rollout.reward: reward 'broken_reward' from miles-broken-plugin 0.0.1 failed to import "
        "(entry point miles.rewards: broken_reward = miles_broken_plugin.reward:score): "
        "ModuleNotFoundError: No module named 'miles_nonexistent_dependency'"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["schedule=fully_async", "placement.mode=colocated"],
            "schedule 'fully_async' needs a disaggregated",
        ),
        (["schedule=fully_async", "transport=colocated"], "schedule 'fully_async' needs a disaggregated"),
        (
            ["transport=colocated", "placement.mode=disaggregated"],
            "transport 'colocated' runs under placement.mode 'colocated', but the recipe sets 'disaggregated'",
        ),
        (
            ["schedule=fully_async", "fully_async.max_inflight=3", "rollout.n_samples_per_prompt=4"],
            "max_inflight (3) must be at least rollout.n_samples_per_prompt (4)",
        ),
        (["schedule=fully_async", "rollout.max_rounds=3"], "leave max_rounds unset"),
        (["mode=sft", "schedule=fully_async"], "mode 'sft' trains synchronously"),
        (["eval={data: {path: x.jsonl}, mode: external}"], "needs eval.backend"),
    ],
)
def test_schedule_and_placement_refusals(overrides: list[str], message: str, pm) -> None:
    from miles.capabilities import check_needs

    with pytest.raises(ConfigError) as info:
        check_needs(load_recipe(TINY, overrides, pm=pm))  # the recipe, or what its transport needs
    assert message in str(info.value)


def test_fully_async_on_a_disaggregated_placement_is_accepted(pm) -> None:
    config = load_recipe(TINY, ["schedule=fully_async", "fully_async.replacement=group"], pm=pm)
    from miles.capabilities import resolved_placement

    assert resolved_placement(config) == "disaggregated"
    assert config.fully_async.update_mode == "retract"
