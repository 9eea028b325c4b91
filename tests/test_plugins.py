"""The plugin core: selecting components by name or import path, conflicts, broken plugins, hooks."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from stevedore import DriverManager

from miles.errors import ComponentError, ConfigError
from miles.interfaces import Loss
from miles.plugins import (
    build_plugin_manager,
    get_plugin_manager,
    list_plugins,
    load_component,
    make_component,
    reset_plugin_state,
    validate_component_ref,
)

if TYPE_CHECKING:
    from plugin_fixtures import FakeSite

# Most tests here select or list the fixture distributions of tests/plugins.
pytestmark = pytest.mark.usefixtures("fixture_plugins")


REWARD_SOURCE = """
def score(sample):
    return 1.0
"""


def _hook_names() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="miles.plugins")}


# ------------------------------------------------------------------ selecting by name


def test_names_resolve_to_the_example_plugins_objects() -> None:
    from miles_example_plugin.loss import ReinforceLoss
    from miles_example_plugin.reward import length_penalty_reward

    assert load_component("reward", "length_penalty") is length_penalty_reward
    assert load_component("loss", "reinforce") is ReinforceLoss
    loss = make_component("loss", "reinforce")
    assert isinstance(loss, ReinforceLoss)
    assert isinstance(loss, Loss)


def test_selecting_one_component_imports_only_its_module() -> None:
    code = (
        "import sys\n"
        "from miles.plugins import load_component\n"
        "load_component('reward', 'length_penalty')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('miles_example_plugin', 'miles_broken', 'torch'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['miles_example_plugin', 'miles_example_plugin.reward']"


def test_unknown_name_suggests_the_closest_and_lists_installed() -> None:
    with pytest.raises(ComponentError) as info:
        load_component("reward", "lenght_penalty")
    message = str(info.value)
    assert message.startswith(
        "no reward named 'lenght_penalty'; did you mean 'length_penalty'? Installed (miles.rewards): "
    )
    assert "length_penalty (miles-example-plugin 0.3.0)" in message
    assert "'package.module:attr'" in message


def test_unknown_name_without_a_close_match() -> None:
    with pytest.raises(
        ComponentError, match=r"^no loss named 'zzz'\. Installed \(miles\.losses\): .*reinforce"
    ):
        load_component("loss", "zzz")


def test_unknown_kind() -> None:
    with pytest.raises(
        ComponentError, match=r"unknown component kind 'rewrd'; kinds are: .*; did you mean 'reward'\?"
    ):
        load_component("rewrd", "length_penalty")


def test_dotted_path_needs_a_colon() -> None:
    with pytest.raises(ComponentError) as info:
        load_component("reward", "miles_example_plugin.reward.length_penalty_reward")
    assert "need a colon" in str(info.value)
    assert "write 'miles_example_plugin.reward:length_penalty_reward'" in str(info.value)


# ---------------------------------------------------------------------- import paths


def test_import_paths_resolve_like_names() -> None:
    import os.path

    from miles_example_plugin.loss import ReinforceLoss

    assert load_component("reward", "miles_example_plugin.reward:length_penalty_reward") is load_component(
        "reward", "length_penalty"
    )
    assert load_component("reward", "os.path:join") is os.path.join
    assert (
        load_component("loss", "miles_example_plugin.loss:ReinforceLoss.__call__") is ReinforceLoss.__call__
    )


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("no_such_module_xyz:f", "reward 'no_such_module_xyz:f': cannot find module 'no_such_module_xyz'"),
        ("os.path:jion", "reward 'os.path:jion': 'os.path' has no attribute 'jion'; did you mean 'join'?"),
        ("os.path:", "reward import path 'os.path:' must look like 'package.module:attr'"),
        (":join", "reward import path ':join' must look like 'package.module:attr'"),
    ],
)
def test_bad_import_paths(ref: str, expected: str) -> None:
    with pytest.raises(ComponentError) as info:
        load_component("reward", ref)
    assert str(info.value).startswith(expected)


def test_import_path_whose_module_fails(fake_site: FakeSite) -> None:
    fake_site.module("explodes_on_import", "raise RuntimeError('boom')\n")
    with pytest.raises(
        ComponentError, match=r"importing module 'explodes_on_import' failed: RuntimeError: boom"
    ) as info:
        load_component("reward", "explodes_on_import:f")
    assert isinstance(info.value.__cause__, RuntimeError)


# ------------------------------------------------------------------------ make_component


def test_make_component_checks_options_and_protocols() -> None:
    with pytest.raises(
        ComponentError, match=r"reward 'length_penalty' is a function, not a class, so it takes no options"
    ):
        make_component("reward", "length_penalty", {"target": 3})
    # A class without an options model: its signature decides.
    with pytest.raises(
        ComponentError, match=r"buffer 'fifo' .* cannot take options \['capacity'\].*it takes: policy"
    ):
        make_component("buffer", "fifo", {"capacity": 2})
    # A plugin class with an options model: the model decides, naming what is allowed.
    with pytest.raises(
        ConfigError,
        match=r"^loss 'reinforce' rejected its options: unknown key 'clip': loss 'reinforce' has no option "
        r"'clip'; allowed: scale$",
    ):
        make_component("loss", "reinforce", {"clip": 0.2})
    assert make_component("loss", "reinforce", {"scale": 2}).scale == 2.0  # validated: a float
    with pytest.raises(
        ComponentError, match=r"does not implement miles.interfaces.Buffer: missing put, take, metrics"
    ):
        make_component("buffer", "collections:OrderedDict")
    with pytest.raises(ComponentError, match=r"reward 'os:sep' must be callable, got str"):
        make_component("reward", "os:sep")


def test_make_component_passes_options_to_classes(fake_site: FakeSite) -> None:
    fake_site.module(
        "fake_buffers",
        """
        class Bounded:
            def __init__(self, capacity: int = 4):
                if capacity < 1:
                    raise ValueError(f"capacity must be >= 1, got {capacity}")
                self.capacity = capacity

            def put(self, group): ...
            def take(self, n_groups): return []
            def metrics(self): return {}
        """,
    )
    assert make_component("buffer", "fake_buffers:Bounded", {"capacity": 3}).capacity == 3
    assert make_component("buffer", "fake_buffers:Bounded").capacity == 4
    with pytest.raises(
        ComponentError, match=r"rejected its options \{'capacity': 0\}: capacity must be >= 1, got 0"
    ):
        make_component("buffer", "fake_buffers:Bounded", {"capacity": 0})
    with pytest.raises(ComponentError, match=r"cannot take options \['size'\].*it takes: capacity"):
        make_component("buffer", "fake_buffers:Bounded", {"size": 3})


# ------------------------------------------------------------------------- broken plugin


def test_selecting_a_broken_component_names_its_distribution() -> None:
    with pytest.raises(ComponentError) as info:
        load_component("reward", "broken_reward")
    assert str(info.value) == (
        "reward 'broken_reward' from miles-broken-plugin 0.0.1 failed to import "
        "(entry point miles.rewards: broken_reward = miles_broken_plugin.reward:score): "
        "ModuleNotFoundError: No module named 'miles_nonexistent_dependency'"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert info.value.__cause__.name == "miles_nonexistent_dependency"


def test_broken_hook_plugin_only_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="miles.plugins"):
        pm = build_plugin_manager(strict=False, disabled=())
    about_broken = [r for r in caplog.records if "miles-broken-plugin" in r.getMessage()]
    assert len(about_broken) == 1
    assert about_broken[0].levelno == logging.WARNING
    assert "\n" not in about_broken[0].getMessage()
    assert (
        "plugin 'broken' from miles-broken-plugin 0.0.1 is broken and was skipped"
        in about_broken[0].getMessage()
    )
    assert [(b.name, b.distribution, b.version) for b in pm.broken] == [
        ("broken", "miles-broken-plugin", "0.0.1")
    ]
    assert pm.has_plugin("example")
    assert not pm.has_plugin("broken")


def test_strict_mode_turns_the_warning_into_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    others = _hook_names() - {"broken"}
    monkeypatch.setenv("MILES_STRICT_PLUGINS", "1")
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", ",".join(others))
    with pytest.raises(
        ComponentError, match=r"hook plugin 'broken' from miles-broken-plugin 0.0.1 failed to import"
    ) as info:
        build_plugin_manager()
    assert "MILES_STRICT_PLUGINS is set" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_disabled_plugins_are_not_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "broken, example")
    with caplog.at_level(logging.WARNING, logger="miles.plugins"):
        pm = build_plugin_manager(strict=True)
    assert pm.broken == []
    assert pm.is_blocked("broken") and pm.is_blocked("example")
    assert not any("miles-broken-plugin" in r.getMessage() for r in caplog.records)


def test_get_plugin_manager_is_cached_per_process() -> None:
    reset_plugin_state()
    first = get_plugin_manager()
    assert get_plugin_manager() is first
    reset_plugin_state()
    assert get_plugin_manager() is not first


# ------------------------------------------------------------------ conflicts (fake dists)


def _two_claimants(site: FakeSite, group: str = "miles.rewards", name: str = "dup") -> None:
    site.module("fake_a_mod", "import sys\nsys.modules[__name__].loaded = True\n" + REWARD_SOURCE)
    site.module("fake_b_mod", REWARD_SOURCE)
    site.dist("miles-fake-a", "1.0", {group: {name: "fake_a_mod:score"}})
    site.dist("miles-fake-b", "2.0", {group: {name: "fake_b_mod:score"}})


def test_two_distributions_claiming_a_name_is_an_error_naming_both(fake_site: FakeSite) -> None:
    _two_claimants(fake_site)
    with pytest.raises(ComponentError) as info:
        load_component("reward", "dup")
    message = str(info.value)
    assert message.startswith("reward 'dup' is provided by 2 distributions: ")
    assert "miles-fake-a 1.0 (fake_a_mod:score)" in message
    assert "miles-fake-b 2.0 (fake_b_mod:score)" in message
    # found on metadata, before either claimant was imported
    assert not fake_site.imported("fake_a_mod") and not fake_site.imported("fake_b_mod")
    with pytest.raises(ComponentError, match="provided by 2 distributions"):
        validate_component_ref("reward", "dup")


def test_the_stevedore_conflict_resolver_names_both_distributions(fake_site: FakeSite) -> None:
    from miles._plugins.components import error_on_conflict

    _two_claimants(fake_site)
    with pytest.raises(
        ComponentError,
        match=r"reward 'dup' is provided by 2 distributions: miles-fake-a 1.0 .*miles-fake-b 2.0",
    ):
        DriverManager(
            "miles.rewards", "dup", on_missing_entrypoints_callback=None, conflict_resolver=error_on_conflict
        )


def test_hook_plugin_name_conflict(fake_site: FakeSite) -> None:
    fake_site.module("fake_hooks_a", "")
    fake_site.module("fake_hooks_b", "")
    fake_site.dist("miles-fake-a", "1.0", {"miles.plugins": {"shared": "fake_hooks_a"}})
    fake_site.dist("miles-fake-b", "2.0", {"miles.plugins": {"shared": "fake_hooks_b"}})
    with pytest.raises(
        ComponentError,
        match=r"hook plugin 'shared' is provided by 2 distributions: miles-fake-a 1.0 .*miles-fake-b 2.0",
    ):
        build_plugin_manager(strict=False, disabled=_hook_names() - {"shared"})
    rows = {row.distribution: row for row in list_plugins(disabled=_hook_names() - {"shared"})}
    assert rows["miles-fake-a"].status == "broken: hooks 'shared' is also provided by miles-fake-b 2.0"
    assert rows["miles-fake-b"].status == "broken: hooks 'shared' is also provided by miles-fake-a 1.0"


# ------------------------------------------------------------------- invalid hook plugins


def test_hookimpl_with_an_argument_the_spec_lacks(fake_site: FakeSite) -> None:
    fake_site.module(
        "fake_bad_sig",
        """
        from miles import hookimpl

        @hookimpl
        def miles_on_metrics(step, metrics, wandb_run):
            pass
        """,
    )
    fake_site.dist("miles-fake-badsig", "0.1", {"miles.plugins": {"badsig": "fake_bad_sig"}})
    with pytest.raises(ComponentError) as info:
        build_plugin_manager(strict=False, disabled=_hook_names() - {"badsig"})
    message = str(info.value)
    assert message.startswith("plugin 'badsig' (miles-fake-badsig 0.1) has an invalid hook implementation: ")
    assert "wandb_run" in message and "\n" not in message
    row = next(
        r for r in list_plugins(disabled=_hook_names() - {"badsig"}) if r.distribution == "miles-fake-badsig"
    )
    assert row.status.startswith("broken: hooks 'badsig' are invalid:")


def test_misspelled_hook_is_caught_by_check_pending(fake_site: FakeSite) -> None:
    fake_site.module(
        "fake_typo",
        """
        from miles import hookimpl

        @hookimpl
        def miles_on_metric(step, metrics):
            pass
        """,
    )
    fake_site.dist("miles-fake-typo", "0.2", {"miles.plugins": {"typo": "fake_typo"}})
    with pytest.raises(
        ComponentError, match=r"^plugin 'typo' \(miles-fake-typo 0.2\): unknown hook 'miles_on_metric'"
    ):
        build_plugin_manager(strict=False, disabled=_hook_names() - {"typo"})


# ------------------------------------------------------------------------------ listing


def test_list_plugins_rows() -> None:
    rows = {row.distribution: row for row in list_plugins()}
    example = rows["miles-example-plugin"]
    assert (example.version, example.status) == ("0.3.0", "active")
    assert example.provides == ["hooks:example", "engine:echo", "loss:reinforce", "reward:length_penalty"]
    broken = rows["miles-broken-plugin"]
    assert broken.status == (
        "broken: hooks 'broken' failed to import: ModuleNotFoundError: No module named 'miles_nonexistent_dependency'; "
        "reward 'broken_reward' failed to import: ModuleNotFoundError: No module named 'miles_nonexistent_dependency'"
    )
    assert "reward:broken_reward" in broken.provides
    assert "hooks:builtins" in rows["miles-core"].provides


def test_list_plugins_imports_components_by_default(fake_site: FakeSite) -> None:
    """A plugin whose hooks load but whose reward cannot import is broken, not 'active'."""
    fake_site.module("fake_ok_reward", REWARD_SOURCE)
    fake_site.module("fake_ok_hooks", "")
    fake_site.module("fake_bad_reward", "import fake_missing_dependency\n" + REWARD_SOURCE)
    fake_site.dist("miles-fake-ok", "1.0", {"miles.rewards": {"fine": "fake_ok_reward:score"}})
    fake_site.dist(
        "miles-fake-gone",
        "1.0",
        {"miles.plugins": {"gonehooks": "fake_ok_hooks"}, "miles.rewards": {"gone": "fake_bad_reward:score"}},
    )
    rows = {row.distribution: row for row in list_plugins(disabled=_hook_names() - {"gonehooks"})}
    assert rows["miles-fake-ok"].status == "active"
    assert fake_site.imported("fake_ok_reward")
    assert rows["miles-fake-gone"].status == (
        "broken: reward 'gone' failed to import: ModuleNotFoundError: No module named 'fake_missing_dependency'"
    )
    assert not rows["miles-fake-gone"].ok
    assert "reward 'broken_reward' failed to import" in rows["miles-broken-plugin"].status


def test_list_plugins_without_check_says_what_it_did_not_import(fake_site: FakeSite) -> None:
    fake_site.module("fake_bad_reward", "import fake_missing_dependency\n")
    fake_site.dist("miles-fake-gone", "1.0", {"miles.rewards": {"gone": "fake_bad_reward:score"}})
    rows = {row.distribution: row for row in list_plugins(check=False, disabled=_hook_names())}
    assert rows["miles-fake-gone"].status == "components not checked"
    assert not fake_site.imported("fake_bad_reward")


def test_list_plugins_marks_disabled_hooks() -> None:
    rows = {row.distribution: row for row in list_plugins(disabled={"broken"})}
    assert rows["miles-broken-plugin"].provides == ["hooks:broken (disabled)", "reward:broken_reward"]
    assert rows["miles-broken-plugin"].status.startswith("broken: reward 'broken_reward' failed to import")
    rows = {row.distribution: row for row in list_plugins(check=False, disabled={"broken"})}
    assert rows["miles-broken-plugin"].status == "components not checked"


# --------------------------------------------------------------- signatures of callables


@pytest.mark.parametrize(
    ("kind", "ref", "expected"),
    [
        # print's signature text depends on whether something earlier in the process wrapped it (in a
        # full CI run it read "(*args, **kwargs)"): only the verdict is checked.
        ("loss", "builtins:print", "and declares no parameter for inputs; a loss is called as loss(inputs)"),
        ("reward", "math:pi", "reward 'math:pi' must be callable, got float"),
        ("correction", "os.path:exists", "takes (path), but a correction is called as "
         "correction(old_logprobs, rollout_logprobs, loss_mask)"),
        ("reward_postprocess", "os.path:exists", "reward_postprocess 'os.path:exists' takes (path), but a "
         "reward_postprocess is called as reward_postprocess(sample, reward)"),
        ("filter", "operator:add", "filter 'operator:add' takes (a, b, /), but a filter is called as filter(group)"),
    ],
)  # fmt: skip
def test_make_component_refuses_a_callable_of_the_wrong_shape(kind: str, ref: str, expected: str) -> None:
    with pytest.raises(ComponentError) as info:
        make_component(kind, ref)
    assert str(info.value).startswith(f"{kind} {ref!r} ")
    assert expected in str(info.value), str(info.value)


# ------------------------------------------------------------------ validate_component_ref


def test_validate_component_ref_imports_nothing(fake_site: FakeSite) -> None:
    fake_site.module("fake_lazy_pkg.rewards", REWARD_SOURCE)
    fake_site.dist("miles-fake-lazy", "1.0", {"miles.rewards": {"lazy": "fake_lazy_pkg.rewards:score"}})
    validate_component_ref("reward", "lazy")
    validate_component_ref("reward", "fake_lazy_pkg.rewards:score")
    assert not fake_site.imported("fake_lazy_pkg.rewards")
    validate_component_ref("reward", "broken_reward")  # its module exists; importing it is what fails


def test_validate_component_ref_errors(fake_site: FakeSite) -> None:
    fake_site.dist("miles-fake-stale", "1.0", {"miles.rewards": {"stale": "fake_removed_module:score"}})
    with pytest.raises(
        ComponentError, match=r"^no reward named 'lenght_penalty'; did you mean 'length_penalty'\?"
    ):
        validate_component_ref("reward", "lenght_penalty")
    with pytest.raises(
        ComponentError,
        match=r"reward 'stale' from miles-fake-stale 1.0 points at module 'fake_removed_module', which does not exist",
    ):
        validate_component_ref("reward", "stale")
    with pytest.raises(ComponentError, match=r"cannot find module 'fake_nowhere'"):
        validate_component_ref("reward", "fake_nowhere:score")
    with pytest.raises(ComponentError, match=r"non-empty string"):
        validate_component_ref("reward", "")
