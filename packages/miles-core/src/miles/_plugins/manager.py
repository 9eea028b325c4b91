"""The pluggy manager: hook plugins found by stevedore, registered and validated by pluggy.

Failure policy. A hook module (``miles.plugins`` entry point) that fails to import is
recorded on the manager (``pm.broken``) and reported as ONE ``logging`` warning on the
``miles.plugins`` logger, and start-up continues; the traceback is logged at DEBUG
(``miles -v``). Logging rather than ``warnings``: it is an environment problem, not a
deprecation in the caller's code, and a ``filterwarnings = error`` test setup must not
turn an unrelated installed plugin into a crash. ``MILES_STRICT_PLUGINS=1`` makes the
failure a ``ComponentError`` instead. ``MILES_DISABLE_PLUGINS=a,b`` keeps the named hook
plugins from being imported at all. Invalid hook implementations (a typo'd hook name,
an argument the hookspec lacks) are always a ``ComponentError`` naming the distribution.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy
from stevedore import NamedExtensionManager

from miles._plugins import discovery
from miles._plugins.components import error_on_conflict
from miles.errors import ComponentError

log = logging.getLogger("miles.plugins")

STRICT_ENV = "MILES_STRICT_PLUGINS"
DISABLE_ENV = "MILES_DISABLE_PLUGINS"


@dataclass(frozen=True)
class BrokenPlugin:
    """A hook plugin that failed to import and was skipped."""

    name: str
    distribution: str
    version: str
    entry_point: str  # the entry point's value, e.g. ``pkg.hooks``
    error: str  # ``ExcType: message``


class MilesPluginManager(pluggy.PluginManager):
    """pluggy's manager plus what miles knows about where each plugin came from."""

    def __init__(self) -> None:
        super().__init__("miles")
        self.sources: dict[str, discovery.EntryPointInfo] = {}  # plugin name -> its entry point
        self.broken: list[BrokenPlugin] = []
        self.disabled: list[str] = []

    def describe(self, plugin_name: str | None) -> str:
        """``plugin 'example' (miles-example-plugin 0.3.0)`` for messages."""
        source = self.sources.get(plugin_name or "")
        where = source.dist_label if source else "registered in code"
        return f"plugin {plugin_name!r} ({where})"


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def disabled_from_env() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def build_plugin_manager(
    *, strict: bool | None = None, disabled: Iterable[str] | None = None
) -> MilesPluginManager:
    """A fresh manager with the hookspecs and every installed hook plugin registered.

    ``strict`` and ``disabled`` default to ``MILES_STRICT_PLUGINS`` and ``MILES_DISABLE_PLUGINS``.
    """
    import miles.hookspecs

    strict = strict_from_env() if strict is None else strict
    blocked = disabled_from_env() if disabled is None else set(disabled)
    pm = MilesPluginManager()
    pm.add_hookspecs(miles.hookspecs)
    for name in sorted(blocked):
        pm.set_blocked(name)
    pm.disabled = sorted(blocked)

    wanted = [n for n in discovery.names(discovery.HOOKS_GROUP) if n not in blocked]
    for name in wanted:
        entries = discovery.providers(discovery.HOOKS_GROUP, name)
        if discovery.conflicting(entries):
            raise ComponentError(discovery.conflict_message(f"hook plugin {name!r}", entries))

    def on_load_failure(_manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        source = discovery.info_for(ep)
        record = BrokenPlugin(
            ep.name, source.distribution, source.version, ep.value, f"{type(err).__name__}: {err}"
        )
        if strict:
            raise ComponentError(
                f"hook plugin {ep.name!r} from {source.dist_label} failed to import ({ep.value}): {record.error} "
                f"[{STRICT_ENV} is set; unset it to skip broken plugins, or set {DISABLE_ENV}={ep.name}]"
            ) from err
        pm.broken.append(record)
        log.warning(
            "plugin %r from %s is broken and was skipped: %s (see `miles plugins`; %s=%s hides it)",
            ep.name,
            source.dist_label,
            record.error,
            DISABLE_ENV,
            ep.name,
        )
        log.debug("traceback of plugin %r from %s", ep.name, source.dist_label, exc_info=err)

    # name_order: pluggy calls hooks in LIFO registration order, so make that order stable.
    extensions = NamedExtensionManager(
        discovery.HOOKS_GROUP,
        names=wanted,
        name_order=True,
        on_load_failure_callback=on_load_failure,
        on_missing_entrypoints_callback=None,
        conflict_resolver=error_on_conflict,
    )
    for ext in extensions:
        pm.sources[ext.name] = discovery.info_for(ext.entry_point)
        try:
            pm.register(ext.plugin, name=ext.name)
        except pluggy.PluginValidationError as err:
            raise ComponentError(
                f"{pm.describe(ext.name)} has an invalid hook implementation: {_one_line(err)}"
            ) from err
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise ComponentError(
            f"{pm.describe(pm.get_name(err.plugin))}: {_one_line(err)}; hooks are listed in "
            "miles.hookspecs (all start with 'miles_')"
        ) from err
    return pm


def _one_line(err: BaseException) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


_PM: MilesPluginManager | None = None
_PM_LOCK = threading.Lock()


def get_plugin_manager() -> MilesPluginManager:
    """The process-wide manager, built on first use (tests build fresh ones with ``build_plugin_manager``)."""
    global _PM
    with _PM_LOCK:
        if _PM is None:
            _PM = build_plugin_manager()
        return _PM


def reset_plugin_state() -> None:
    """Forget the cached manager and every entry-point cache (after ``sys.path`` changed)."""
    global _PM
    from stevedore.extension import ExtensionManager

    with _PM_LOCK:
        _PM = None
    discovery.clear_index()
    # stevedore keeps the entry points it read per namespace for the life of the process.
    ExtensionManager.ENTRY_POINT_CACHE.clear()


def collect_config_sections(pm: pluggy.PluginManager) -> dict[str, Any]:
    """The config sections plugins contribute, by section name (values are ``ConfigSection``).

    Each implementation is called on its own so that a clash can name both plugins.
    """
    from pydantic import BaseModel

    from miles.config.schema import MilesConfig
    from miles.config.sections import ConfigSection

    describe = pm.describe if isinstance(pm, MilesPluginManager) else (lambda n: f"plugin {n!r}")
    reserved = set(MilesConfig.model_fields)
    sections: dict[str, ConfigSection] = {}
    owners: dict[str, str] = {}
    for impl in pm.hook.miles_config_sections.get_hookimpls():
        if impl.wrapper or impl.hookwrapper:
            continue
        who = describe(impl.plugin_name)
        result: Any = impl.function()  # a plugin's return value, checked below
        items = [result] if isinstance(result, ConfigSection) else list(result or [])
        for section in items:
            if not isinstance(section, ConfigSection):
                raise ComponentError(
                    f"{who} returned {section!r} from miles_config_sections; expected ConfigSection records"
                )
            if not (isinstance(section.model, type) and issubclass(section.model, BaseModel)):
                raise ComponentError(
                    f"{who}: config section {section.name!r} needs a pydantic model, got {section.model!r}"
                )
            if not section.name.isidentifier():
                raise ComponentError(
                    f"{who}: config section name {section.name!r} must be a Python identifier"
                )
            if section.name in reserved:
                raise ComponentError(
                    f"{who} claims config section {section.name!r}, which is built into miles"
                )
            if section.name in sections:
                raise ComponentError(
                    f"config section {section.name!r} is claimed twice: by {owners[section.name]} and by {who}"
                )
            sections[section.name] = section
            owners[section.name] = who
    return sections
