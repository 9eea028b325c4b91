"""A plugin adds a kind of component through ``miles.kinds``, and it behaves like a core kind.

Real distributions on ``sys.path`` (``fake_site``): the loader finds the kind declaration, resolves
components of that kind from its group, checks them against its protocol or call signature,
validates their options, and refuses a broken declaration with one message naming it.
"""

from __future__ import annotations

import pytest
from plugin_fixtures import FakeSite

from miles.errors import ComponentError
from miles.plugins import CORE_KIND_GROUPS, kind_groups, make_component

KIND_MODULE = """
from miles.plugins import ComponentKind

SCORER = ComponentKind(group="miles.scorers", protocol="shop.contracts:Scorer")
JUDGE = ComponentKind(group="miles.judges", called_with=("question", "answer"), options="mapping")
"""
CONTRACTS = """
from typing import Protocol, runtime_checkable

@runtime_checkable
class Scorer(Protocol):
    def score(self, text: str) -> float: ...
"""
COMPONENTS = """
class LengthScorer:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def score(self, text: str) -> float:
        return self.scale * len(text)

class NotAScorer:
    pass

def judge(question, answer):
    return answer == "4"

def one_argument(answer):
    return True
"""


def _install_shop(site: FakeSite, kinds: dict[str, str] | None = None) -> None:
    site.module("shop.kinds", KIND_MODULE)
    site.module("shop.contracts", CONTRACTS)
    site.module("shop.components", COMPONENTS)
    site.dist(
        "miles-shop",
        "1.0",
        {
            "miles.kinds": kinds or {"scorer": "shop.kinds:SCORER", "judge": "shop.kinds:JUDGE"},
            "miles.scorers": {
                "length": "shop.components:LengthScorer",
                "broken": "shop.components:NotAScorer",
            },
            "miles.judges": {"exact": "shop.components:judge", "short": "shop.components:one_argument"},
        },
    )


def test_a_declared_kind_resolves_checks_and_builds_its_components(fake_site: FakeSite) -> None:
    _install_shop(fake_site)
    assert kind_groups()["scorer"] == "miles.scorers" and "scorer" not in CORE_KIND_GROUPS
    scorer = make_component("scorer", "length", {"scale": 2.0})
    assert scorer.score("abc") == 6.0
    assert make_component("judge", "exact")("2+2?", "4") is True
    with pytest.raises(ComponentError, match=r"does not implement shop\.contracts\.Scorer: missing score"):
        make_component("scorer", "broken")
    with pytest.raises(ComponentError, match=r"a judge is called as judge\(question, answer\)"):
        make_component("judge", "short")
    with pytest.raises(ComponentError, match=r"no scorer named 'lenght'; did you mean 'length'"):
        make_component("scorer", "lenght")


def test_an_unknown_kind_lists_the_declared_ones(fake_site: FakeSite) -> None:
    _install_shop(fake_site)
    with pytest.raises(
        ComponentError, match=r"unknown component kind 'scorers'.*scorer.*did you mean 'scorer'"
    ):
        make_component("scorers", "length")


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        (
            "shop.kinds:MISSING",
            r"component kind 'odd' from miles-shop 1\.0 .* failed to load: AttributeError",
        ),
        ("shop.components:judge", r"must point at a miles\.plugins\.ComponentKind, got function"),
    ],
)
def test_a_broken_declaration_is_refused_naming_it(
    fake_site: FakeSite, declaration: str, message: str
) -> None:
    _install_shop(fake_site, {"odd": declaration})
    with pytest.raises(ComponentError, match=message):
        make_component("odd", "x")


def test_a_declaration_may_not_take_a_core_kind(fake_site: FakeSite) -> None:
    _install_shop(fake_site, {"reward": "shop.kinds:SCORER"})
    with pytest.raises(ComponentError, match=r"reuses the name of one of the core's kinds"):
        kind_groups()
    # a core kind resolves without reading the declarations at all
    assert make_component("reward", "exact_match") is not None


def test_miles_envs_declares_its_kinds() -> None:
    """The agentic kinds are miles-envs's: the core's table does not name them."""
    groups = kind_groups()
    for kind in ("agent", "toolset", "session_matcher"):
        assert kind not in CORE_KIND_GROUPS and kind in groups
    assert make_component("toolset", "calculator").specs()
