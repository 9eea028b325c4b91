"""The data behind ``miles plugins``: one row per distribution that provides anything to miles.

Hook modules are imported (they are meant to be light) and validated against the
hookspecs, each in a scratch manager. Driver entry points (backends, losses, ...) are
imported too by default: a listing that calls a plugin ``active`` must have seen it
load, and a reward whose module cannot import is exactly what a user runs
``miles plugins`` to find. That costs a few seconds (backends import torch);
``check=False`` (``miles plugins --no-check``) lists from metadata and hook modules only,
and says ``components not checked`` instead of ``active`` for what it did not import.
"""

from __future__ import annotations

import importlib.metadata
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import pluggy
from stevedore import NamedExtensionManager

from miles._plugins import discovery, hints
from miles._plugins.components import error_on_conflict
from miles._plugins.manager import MilesPluginManager, disabled_from_env


@dataclass
class PluginInfo:
    """One installed distribution as ``miles plugins`` shows it."""

    distribution: str
    version: str
    provides: list[str]  # ``kind:name`` (``reward:length_penalty``), hook plugins as ``hooks:name``
    status: (
        str  # ``active``, ``components not checked`` (check=False), or ``broken: <reason>[; <reason>...]``
    )
    problems: list[str] = field(default_factory=list)
    # With details: each component's options by ``kind:name``, one dict per option (name, type,
    # default, description); a component without an options model is absent (free-form options).
    options: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_plugins(
    *, check: bool = True, disabled: set[str] | None = None, details: bool = False
) -> list[PluginInfo]:
    """Every distribution with ``miles.*`` entry points, with what it provides and its status.

    ``check`` imports every driver entry point and reports those that fail; without it
    only hook modules are imported. ``details`` also loads each component that takes recipe
    options and lists the fields of its options model (``PluginInfo.options``).
    """
    blocked = disabled_from_env() if disabled is None else disabled
    entries = discovery.all_entry_points()
    by_dist: dict[tuple[str, str], list[discovery.EntryPointInfo]] = defaultdict(list)
    for e in entries:
        by_dist[(e.distribution, e.version)].append(e)
    problems: dict[tuple[str, str], list[str]] = defaultdict(list)

    def report(entry: discovery.EntryPointInfo, message: str) -> None:
        problems[(entry.distribution, entry.version)].append(message)

    _report_conflicts(entries, report)
    hooks = [e for e in entries if e.group == discovery.HOOKS_GROUP and e.name not in blocked]
    _check_hook_plugins(hooks, report)
    if check:
        for group in discovery.kind_groups().values():
            _check_drivers(group, [e for e in entries if e.group == group], report)

    rows = []
    for (dist, version), provided in sorted(by_dist.items(), key=lambda kv: kv[0][0].lower()):
        labels = []
        for e in sorted(provided, key=lambda e: (e.kind != "hooks", e.kind, e.name)):
            label = f"{e.kind}:{e.name}"
            if e.group == discovery.HOOKS_GROUP and e.name in blocked:
                label += " (disabled)"
            labels.append(label)
        found = problems.get((dist, version), [])
        unchecked = not check and any(e.group != discovery.HOOKS_GROUP for e in provided)
        if found:
            status = "broken: " + "; ".join(found)
        else:
            status = "components not checked" if unchecked else "active"
        info = PluginInfo(dist, version, labels, status, list(found))
        if details:
            info.options = _options_of(provided)
        rows.append(info)
    return rows


def _options_of(provided: list[discovery.EntryPointInfo]) -> dict[str, list[dict[str, str]]]:
    from miles.capabilities import options_model
    from miles.config.options import option_fields, option_kinds
    from miles.errors import MilesError
    from miles.plugins import load_component

    out: dict[str, list[dict[str, str]]] = {}
    kinds = option_kinds()
    for e in sorted(provided, key=lambda e: (e.kind, e.name)):
        if e.kind not in kinds:
            continue
        try:
            model = options_model(load_component(e.kind, e.name), f"{e.kind} {e.name!r}")
        except MilesError:
            continue  # the status already says why it does not load
        if model is not None:
            out[f"{e.kind}:{e.name}"] = [f.to_dict() for f in option_fields(model)]
    return out


def _report_conflicts(entries: list[discovery.EntryPointInfo], report: Any) -> None:
    by_key: dict[tuple[str, str], list[discovery.EntryPointInfo]] = defaultdict(list)
    for e in entries:
        by_key[(e.group, e.name)].append(e)
    for claimants in by_key.values():
        if not discovery.conflicting(claimants):
            continue
        for e in claimants:
            others = ", ".join(o.dist_label for o in claimants if o is not e)
            report(e, f"{e.kind} {e.name!r} is also provided by {others}")


def _check_hook_plugins(hooks: list[discovery.EntryPointInfo], report: Any) -> None:
    import miles.hookspecs

    by_name = {(e.name, e.value): e for e in hooks}

    def on_failure(_manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        report(
            by_name.get((ep.name, ep.value)) or discovery.info_for(ep),
            f"hooks {ep.name!r} failed to import: {type(err).__name__}: {err}",
        )

    loaded = NamedExtensionManager(
        discovery.HOOKS_GROUP,
        names=sorted({e.name for e in hooks}),
        on_load_failure_callback=on_failure,
        on_missing_entrypoints_callback=None,
        conflict_resolver=error_on_conflict,
    )
    for ext in loaded.extensions:
        # A scratch manager per plugin, so one plugin's problem is reported against it alone.
        scratch = MilesPluginManager()
        scratch.add_hookspecs(miles.hookspecs)
        entry = by_name.get((ext.name, ext.entry_point.value)) or discovery.info_for(ext.entry_point)
        try:
            scratch.register(ext.plugin, name=ext.name)
            scratch.check_pending()
        except pluggy.PluginValidationError as err:
            detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
            report(entry, f"hooks {ext.name!r} are invalid: {detail}")


def _check_drivers(group: str, declared: list[discovery.EntryPointInfo], report: Any) -> None:
    if not declared:
        return
    by_key = {(e.name, e.value): e for e in declared}

    def on_failure(_manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        entry = by_key.get((ep.name, ep.value)) or discovery.info_for(ep)
        missing = hints.missing_library(err)
        report(
            entry,
            f"{entry.kind} {ep.name!r} failed to import: {type(err).__name__}: {err}"
            + (f"; {missing}" if missing else ""),
        )

    NamedExtensionManager(
        group,
        names=sorted({e.name for e in declared}),
        on_load_failure_callback=on_failure,
        on_missing_entrypoints_callback=None,
        conflict_resolver=error_on_conflict,
    )
