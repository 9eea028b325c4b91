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

from miles._plugins.kinds import KINDS_GROUP, ComponentKind
from miles.errors import ComponentError

HOOKS_GROUP = "miles.plugins"

# The core's kinds (what the recipe and the API say) -> entry-point group (where distributions
# declare their components). Plugins add kinds of their own through ``miles.kinds``
# (``declared_kinds``); ``kind_groups`` is the whole vocabulary.
CORE_KIND_GROUPS: dict[str, str] = {
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
    "tracker": "miles.trackers",
    # Engine-side halves of transports, mounted by the embedded engine (miles.engines.embedded.receivers).
    "engine_receiver": "miles.engine_receivers",
}
_CORE_GROUP_KINDS: dict[str, str] = {group: kind for kind, group in CORE_KIND_GROUPS.items()}


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
        """``reward``, ``loss``, ... (a plugin's own kinds too), ``kind`` for a kind declaration,
        or ``hooks`` for the ``miles.plugins`` group."""
        return kind_for_group(self.group)

    @property
    def module(self) -> str:
        return self.value.partition(":")[0].strip()

    @property
    def dist_label(self) -> str:
        return f"{self.distribution} {self.version}"


_INDEX: dict[tuple[str, ...], list[EntryPointInfo]] = {}
_KINDS: dict[tuple[str, ...], dict[str, ComponentKind]] = {}


def clear_index() -> None:
    _INDEX.clear()
    _KINDS.clear()


def all_entry_points() -> list[EntryPointInfo]:
    """Every entry point in a group of the loader's (a kind's, the hooks', the kind declarations'),
    cached per ``sys.path``."""
    groups = {*CORE_KIND_GROUPS.values(), HOOKS_GROUP, KINDS_GROUP}
    groups.update(kind.group for kind in declared_kinds().values())
    return [e for e in _entries() if e.group in groups]


def _entries() -> list[EntryPointInfo]:
    """Every entry point in any ``miles.*`` group (commands and a plugin's own groups too)."""
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
            if not ep.group.startswith("miles."):
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
    return [e for e in _entries() if e.group == group and e.name == name]


def names(group: str) -> list[str]:
    return sorted({e.name for e in _entries() if e.group == group})


def info_for(ep: importlib.metadata.EntryPoint) -> EntryPointInfo:
    """The distribution behind an entry point object handed out by stevedore."""
    for e in providers(ep.group, ep.name):
        if e.value == ep.value:
            return e
    return EntryPointInfo(ep.group, ep.name, ep.value, "<unknown distribution>", "?")


def group_for(kind: str) -> str:
    if kind in CORE_KIND_GROUPS:
        return CORE_KIND_GROUPS[kind]
    declared = declared_kinds()
    if kind in declared:
        return declared[kind].group
    from miles._plugins import hints

    hint = hints.kind_hint(kind)
    if hint is not None:
        raise ComponentError(hint)
    every = kind_groups()
    raise ComponentError(
        f"unknown component kind {kind!r}; kinds are: {', '.join(every)}{did_you_mean(kind, every)}"
        + (
            f" (plugins declare kinds in the {KINDS_GROUP!r} entry-point group: "
            f"{describe_installed(KINDS_GROUP)})"
        )
    )


def kind_groups() -> dict[str, str]:
    """Every component kind -> its entry-point group: the core's, then those plugins declare."""
    return {**CORE_KIND_GROUPS, **{name: kind.group for name, kind in declared_kinds().items()}}


def declared_kind(kind: str) -> ComponentKind | None:
    """The declaration of a plugin's kind; ``None`` for a core kind or an unknown one."""
    if kind in CORE_KIND_GROUPS:
        return None
    return declared_kinds().get(kind)


def kind_for_group(group: str) -> str:
    """The kind whose components ``group`` holds (``hooks`` for ``miles.plugins``)."""
    if group in _CORE_GROUP_KINDS:
        return _CORE_GROUP_KINDS[group]
    if group == KINDS_GROUP:
        return "kind"
    for name, kind in declared_kinds().items():
        if kind.group == group:
            return name
    return "hooks"


def declared_kinds() -> dict[str, ComponentKind]:
    """The kinds plugins declare in ``miles.kinds``, loaded once per ``sys.path``.

    Each declaration's module is imported (it holds a ``ComponentKind`` and imports nothing
    heavy). A declaration that does not load, is not a ``ComponentKind``, reuses a core kind's
    name or group, or is made by two distributions raises ``ComponentError``.
    """
    key = tuple(sys.path)
    if key not in _KINDS:
        _KINDS[key] = _load_declared_kinds()
    return _KINDS[key]


def _load_declared_kinds() -> dict[str, ComponentKind]:
    import importlib

    kinds: dict[str, ComponentKind] = {}
    for name in names(KINDS_GROUP):
        entries = providers(KINDS_GROUP, name)
        if conflicting(entries):
            raise ComponentError(conflict_message(f"component kind {name!r}", entries))
        entry = entries[0]
        where = f"component kind {name!r} from {entry.dist_label} (entry point {KINDS_GROUP}: {name} = {entry.value})"
        if name in CORE_KIND_GROUPS:
            raise ComponentError(f"{where} reuses the name of one of the core's kinds; choose another name")
        module_name, _, attr = entry.value.partition(":")
        try:
            obj: object = importlib.import_module(module_name.strip())
            for part in attr.strip().split(".") if attr.strip() else []:
                obj = getattr(obj, part)
        except Exception as err:
            raise ComponentError(f"{where} failed to load: {type(err).__name__}: {err}") from err
        if not isinstance(obj, ComponentKind):
            raise ComponentError(
                f"{where} must point at a miles.plugins.ComponentKind, got {type(obj).__name__}"
            )
        if obj.group in _CORE_GROUP_KINDS or obj.group == HOOKS_GROUP:
            raise ComponentError(f"{where} uses the group {obj.group!r}, which the core owns")
        kinds[name] = obj
    return kinds


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
    for e in _entries():
        if e.group == group:
            by_name[e.name].append(e.dist_label)
    if not by_name:
        return "none"
    return ", ".join(f"{n} ({' / '.join(dists)})" for n, dists in sorted(by_name.items()))
