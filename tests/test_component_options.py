"""Component options as pydantic models: validated with file/line errors, listed, in the schema.

A component declares its options as a model (``Options`` on a class, ``declare_options`` on a
function). ``miles config validate`` and the run's pre-flight check every ``*_options``
mapping of a recipe against the model of the component it configures; ``miles plugins
--details`` and ``miles config schema`` show the fields. The example plugin's ``reinforce``
loss (``scale: float > 0``) and ``echo`` engine kind are third-party components with models.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles.capabilities import options_model, takes_options_as_mapping
from miles.cli import cli
from miles.config import RecipeError, load_recipe
from miles.config.options import check_component_options, option_kinds
from miles.plugins import kind_groups, load_component, make_component

pytestmark = pytest.mark.usefixtures("fixture_plugins_for_module")

BASE = """\
model:
  path: builtin:tiny-qwen3
data:
  path: builtin:arith
"""


def _recipe(tmp_path: Path, body: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(BASE + textwrap.dedent(body))
    return str(path)


def _problems(recipe: str, *overrides: str) -> list[str]:
    config = load_recipe(recipe, list(overrides))
    with pytest.raises(RecipeError) as info:
        check_component_options(config)
    return info.value.problems


def _validate(*args: str):
    return CliRunner().invoke(cli, ["config", "validate", *args])


# ------------------------------------------------------------------------ one clear error


def test_a_bad_option_value_is_one_error_naming_the_file_and_line(tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        """\
        algorithm:
          loss: ppo_clip
          loss_options:
            clip_low: 0.1
            kl_type: k5
        """,
    )
    result = _validate(recipe)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert [line for line in result.stderr.splitlines() if not line.startswith("warning: ")] == [
        f"Error: recipe {recipe}: algorithm.loss_options.kl_type ({recipe}:9): got 'k5'; option 'kl_type' "
        "('k1' | 'k2' | 'k3') of loss 'ppo_clip' must be 'k1', 'k2' or 'k3'"
    ]


def test_an_unknown_option_key_is_refused_with_what_is_allowed(tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        """\
        rollout:
          reward: numeric_closeness
          reward_options:
            scal: 5
        """,
    )
    assert _problems(recipe) == [
        f"unknown key 'rollout.reward_options.scal' ({recipe}:8): reward 'numeric_closeness' has no option "
        "'scal' (did you mean 'scale'?); allowed: scale"
    ]
    # An override is located at the --set that made it.
    assert _problems(recipe, "weight_sync.options.flaten=true") == [
        f"unknown key 'rollout.reward_options.scal' ({recipe}:8): reward 'numeric_closeness' has no option "
        "'scal' (did you mean 'scale'?); allowed: scale",
        "unknown key 'weight_sync.options.flaten' (--set weight_sync.options.flaten=true): transport 'broadcast' "
        "has no option 'flaten' (did you mean 'flatten'?); allowed: bucket_mb, dtype, check_equal, check_mode, "
        "check_skip, backend, master_address, master_port, ranks_per_engine, group_name, timeout_s, flatten",
    ]


def test_a_missing_required_option_points_at_the_component(tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        """\
        rollout:
          reward: remote
        """,
    )
    [problem] = _problems(recipe)
    assert problem == (
        f"missing key 'rollout.reward_options.url' ({recipe}:6): reward 'remote' needs option 'url' "
        "(the reward service's endpoint (http or https))"
    )


def test_types_are_strict(tmp_path: Path) -> None:
    """A quoted number is not a number and true is not 1 (the YAML says what it is)."""
    recipe = _recipe(tmp_path, "algorithm:\n  advantage_options:\n    eps: '0.1'\n    normalize_std: 1\n")
    assert _problems(recipe) == [
        f"algorithm.advantage_options.normalize_std ({recipe}:8): got 1; option 'normalize_std' (bool) of "
        "advantage 'grpo' must be a valid boolean",
        f"algorithm.advantage_options.eps ({recipe}:7): got '0.1'; option 'eps' (float) of advantage 'grpo' "
        "must be a valid number",
    ]


def test_a_value_matching_no_member_of_a_union_is_one_problem(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, "rollout:\n  reward: remote\n  reward_options:\n    url: http://h/\n")
    assert _problems(recipe, "data.source=hf", "data.options={data_files: 5}") == [
        "data.options.data_files (--set data.options={data_files: 5}): got 5; option 'data_files' "
        "(str | list[str] | dict[str, Any] | None) of data_source 'hf' must be str | list[str] | dict[str, Any] | None"
    ]
    # Inside a mapping, the key is named.
    assert _problems(recipe, "rollout.reward_options.headers={X-Token: 1}") == [
        "rollout.reward_options.headers.X-Token (--set rollout.reward_options.headers={X-Token: 1}): got 1; "
        "option 'headers' (dict[str, str] | None) of reward 'remote' must be a valid string"
    ]


def test_the_runs_preflight_refuses_bad_options_before_anything_heavy(tmp_path: Path) -> None:
    """The pre-flight checks options before it resolves the model (which would fail here too)."""
    from miles.driver.preflight import preflight

    recipe = _recipe(tmp_path, "algorithm:\n  correction_options:\n    hihg: 3.0\n")
    config = load_recipe(recipe, ["model.path=/nonexistent/model"])
    with pytest.raises(RecipeError, match=r"unknown key 'algorithm.correction_options.hihg' \(.*:7\): "):
        preflight(config)


def test_components_without_a_model_keep_free_form_options(tmp_path: Path) -> None:
    (tmp_path / "free_rollout.py").write_text(
        "async def generate(ctx, sample):\n    return sample\n\nclass Scale:\n"
        "    def __init__(self, **anything):\n        self.anything = anything\n"
        "    def __call__(self, sample):\n        return 1.0\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        # rollout.options goes to the rollout and the generate function: the built-in rollout takes
        # none, but a generate function without a model may read any key.
        recipe = _recipe(tmp_path, "rollout:\n  options:\n    my_key: 1\n")
        assert "rollout.options.my_key" in _problems(recipe)[0]
        config = load_recipe(
            recipe, ["rollout.generate_fn=free_rollout:generate", "rollout.reward=free_rollout:Scale"]
        )
        config.rollout.reward_options = {"whatever": [1, 2]}
        check_component_options(config)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("free_rollout", None)


# ------------------------------------------------------------------------ third-party plugins


def test_a_plugin_components_model_is_validated_the_same_way(tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        """\
        algorithm:
          loss: reinforce
          loss_options:
            scale: 0
        engine:
          launcher: echo
          options:
            weight_versions: 1
        """,
    )
    assert _problems(recipe) == [
        f"algorithm.loss_options.scale ({recipe}:8): got 0; option 'scale' (float) of loss 'reinforce' "
        "must be greater than 0",
        f"unknown key 'engine.options.weight_versions' ({recipe}:12): engine 'echo' has no option "
        "'weight_versions' (did you mean 'weight_version'?); allowed: url, weight_version",
    ]
    # The made loss gets the validated value.
    assert make_component("loss", "reinforce", {"scale": 3}).scale == 3.0


def test_plugins_details_lists_each_components_options() -> None:
    result = CliRunner().invoke(cli, ["plugins", "--details", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["distribution"]: row for row in json.loads(result.stdout)}
    assert rows["miles-example-plugin"]["options"] == {
        "engine:echo": [
            {
                "name": "url",
                "type": "str | None",
                "default": "None",
                "description": "the echo:// address to attach to",
            },
            {
                "name": "weight_version",
                "type": "int | None",
                "default": "None",
                "description": "the weight version it starts at",
            },
        ],
        "loss:reinforce": [
            {"name": "scale", "type": "float", "default": "1.0", "description": "multiplies the loss (> 0)"}
        ],
    }
    core = rows["miles-core"]["options"]
    assert core["loss:ppo_clip"][0] == {
        "name": "clip_low",
        "type": "float",
        "default": "0.2",
        "description": "the ratio is clipped below at 1 - clip_low, in [0, 1)",
    }
    assert core["rollout:default"] == []  # takes none: every key is refused
    assert "reward:math" not in core  # a function reward takes no options at all
    table = CliRunner().invoke(cli, ["plugins", "--details"])
    assert table.exit_code == 0
    assert "loss:reinforce (miles-example-plugin) options:" in table.stdout
    assert "multiplies the loss (> 0)" in table.stdout
    plain = CliRunner().invoke(cli, ["plugins", "--json"])
    assert all(row["options"] == {} for row in json.loads(plain.stdout))  # only with --details


def test_config_schema_includes_the_components_options() -> None:
    result = CliRunner().invoke(cli, ["config", "schema"])
    assert result.exit_code == 0, result.output
    options = json.loads(result.stdout)["x-miles-component-options"]
    reinforce = options["miles.losses"]["reinforce"]
    assert reinforce["properties"]["scale"] == {
        "default": 1.0,
        "description": "multiplies the loss (> 0)",
        "exclusiveMinimum": 0,
        "title": "Scale",
        "type": "number",
    }
    assert reinforce["additionalProperties"] is False
    assert set(options["miles.transports"]["broadcast"]["properties"]) >= {"bucket_mb", "flatten"}
    assert "math" not in options["miles.rewards"]


# ------------------------------------------------------------------------ built-ins agree


def _builtin_components() -> list[tuple[str, str, object]]:
    found = []
    groups = kind_groups()
    for kind in option_kinds():
        group = groups[kind]
        for ep in importlib.metadata.entry_points(group=group):
            if ep.dist is not None and ep.dist.name in ("miles-core", "miles-transports"):
                found.append((kind, ep.name, load_component(kind, ep.name)))
    return found


def test_every_builtin_class_taking_keyword_options_declares_a_model_that_matches_it() -> None:
    """Where a model describes a class's keyword arguments, names and defaults agree with __init__."""
    checked = []
    for kind, name, component in _builtin_components():
        if not isinstance(component, type) or takes_options_as_mapping(kind):
            continue
        params = {
            p.name: p.default
            for p in inspect.signature(component).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        model = options_model(component, f"{kind} {name!r}")
        assert model is not None, f"{kind} {name!r} takes {sorted(params)} but declares no options model"
        fields = model.model_fields
        assert sorted(fields) == sorted(params), (kind, name)
        for option, default in params.items():
            expected = fields[option].default if not fields[option].is_required() else inspect.Parameter.empty
            if isinstance(default, tuple):
                default = tuple(default)
            assert expected == default, (
                f"{kind} {name!r}: {option} defaults to {default!r}, its model says {expected!r}"
            )
        checked.append(f"{kind}:{name}")
    assert len(checked) >= 20, checked


def test_engine_kinds_accept_exactly_their_models_fields() -> None:
    for name in ("embedded", "sglang"):
        launcher = make_component("engine", name)
        model = options_model(type(launcher), f"engine {name!r}")
        assert model is not None
        assert launcher._allowed_options() == set(model.model_fields)
    # The embedded kind takes the installed receivers' launch options too (disk-delta's delta_root).
    assert "delta_root" in options_model(load_component("engine", "embedded"), "embedded").model_fields


def test_checking_the_default_recipes_options_imports_no_engine_receiver(tmp_path: Path) -> None:
    """The embedded engine's model adds its receivers' options (importing them, and torch with p2p's);
    keys the engine always has are checked without them, so `miles config validate` stays light."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from miles.config import load_recipe\n"
        "from miles.config.options import check_component_options\n"
        "check_component_options(load_recipe('default'))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'transformers'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stderr
    # A receiver's option is checked against the whole model.
    recipe = _recipe(tmp_path, "engine:\n  options:\n    delta_root: 5\n")
    assert _problems(recipe) == [
        f"engine.options.delta_root ({recipe}:7): got 5; option 'delta_root' (str | None) of engine 'embedded' "
        "must be a valid string"
    ]
