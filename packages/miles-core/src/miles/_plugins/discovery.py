"""Which miles entry points are installed, and which distribution provides each one.

stevedore reads entry points through its own cache, whose ``EntryPoint`` objects carry
no ``.dist``; error messages and ``miles plugins`` need the distribution and version,
so this module builds its own ``(group, name, value) -> distribution`` index from
``importlib.metadata`` once per ``sys.path`` (reading metadata only, importing nothing).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from miles.errors import ComponentError

HOOKS_GROUP = "miles.plugins"

# kind (what the recipe and the API say) -> entry-point group (where distributions declare it)
KIND_GROUPS: dict[str, str] = {
    "backend": "miles.backends",
    "transport": "miles.transports",
    "buffer": "miles.buffers",
    "loss": "miles.losses",
    "correction": "miles.corrections",
    "advantage": "miles.advantages",
    "rollout": "miles.rollouts",
    "generate": "miles.generates",
    "reward": "miles.rewards",
    "reward_postprocess": "miles.reward_postprocessors",
    "filter": "miles.filters",
    "data_source": "miles.data_sources",
    "engine": "miles.engines",
    "eval_backend": "miles.eval_backends",
    "session_matcher": "miles.session_matchers",
    "agent": "miles.agents",
    "toolset": "miles.toolsets",
    "tracker": "miles.trackers",
    # Engine-side halves of transports, mounted by the embedded engine (miles.engines.embedded.receivers).
    "engine_receiver": "miles.engine_receivers",
}
GROUP_KINDS: dict[str, str] = {group: kind for kind, group in KIND_GROUPS.items()}
ALL_GROUPS: tuple[str, ...] = (*KIND_GROUPS.values(), HOOKS_GROUP)


@dataclass(frozen=True)
class EntryPointInfo:
    """One declared entry point and the distribution that declares it."""

    group: str
    name: str
    value: str
    distribution: str
    version: str

    @property
    def kind(self) -> str:
        """``reward``, ``loss``, ... or ``hooks`` for the ``miles.plugins`` group."""
        return GROUP_KINDS.get(self.group, "hooks")

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    @property
    def dist_label(self) -> str:
        return f"{self.distribution} {self.version}"


_INDEX: dict[tuple[str, ...], list[EntryPointInfo]] = {}


def clear_index() -> None:
    _INDEX.clear()


def all_entry_points() -> list[EntryPointInfo]:
    """Every entry point in a ``miles.*`` group, cached per ``sys.path``."""
    key = tuple(sys.path)
    if key not in _INDEX:
        _INDEX[key] = _scan()
    return _INDEX[key]


def _scan() -> list[EntryPointInfo]:
    found: dict[tuple[str, str, str, str], EntryPointInfo] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or "<unknown distribution>"
        version = dist.version or "?"
        for ep in dist.entry_points:
            if ep.group not in ALL_GROUPS:
                continue
            info = EntryPointInfo(ep.group, ep.name, ep.value, name, version)
            # A distribution visible twice on sys.path (an editable checkout next to an
            # install) is one provider, not a conflict.
            found.setdefault((ep.group, ep.name, ep.value, _normalize(name)), info)
    return sorted(found.values(), key=lambda e: (e.group, e.name, e.distribution))


def _normalize(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


def providers(group: str, name: str) -> list[EntryPointInfo]:
    """The entry points named ``name`` in ``group``; more than one distribution is a conflict."""
    return [e for e in all_entry_points() if e.group == group and e.name == name]


def names(group: str) -> list[str]:
    return sorted({e.name for e in all_entry_points() if e.group == group})


def info_for(ep: importlib.metadata.EntryPoint) -> EntryPointInfo:
    """The distribution behind an entry point object handed out by stevedore."""
    for e in providers(ep.group, ep.name):
        if e.value == ep.value:
            return e
    return EntryPointInfo(ep.group, ep.name, ep.value, "<unknown distribution>", "?")


def group_for(kind: str) -> str:
    try:
        return KIND_GROUPS[kind]
    except KeyError:
        raise ComponentError(
            f"unknown component kind {kind!r}; kinds are: {', '.join(KIND_GROUPS)}{did_you_mean(kind, KIND_GROUPS)}"
        ) from None


def conflicting(entries: list[EntryPointInfo]) -> bool:
    return len({_normalize(e.distribution) for e in entries}) > 1


def conflict_message(what: str, entries: list[EntryPointInfo]) -> str:
    listed = ", ".join(f"{e.dist_label} ({e.value})" for e in sorted(entries, key=lambda e: e.distribution))
    return (
        f"{what} is provided by {len(entries)} distributions: {listed}; "
        "names must be unique, so uninstall one of them or select the one you want by import path"
    )


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def describe_installed(group: str) -> str:
    """``a (dist 1.0), b (dist 2.0)``, or ``none`` when nothing is installed in ``group``."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for e in all_entry_points():
        if e.group == group:
            by_name[e.name].append(e.dist_label)
    if not by_name:
        return "none"
    return ", ".join(f"{n} ({' / '.join(dists)})" for n, dists in sorted(by_name.items()))
