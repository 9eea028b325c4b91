"""Plugins: how miles finds components and calls hooks.

Two libraries, two jobs, no entry-point group read by both:

* **stevedore decides what is imported.** A component (a backend, a loss, a reward...)
  is a named entry point in its kind's group (``miles.rewards``, ``miles.losses``, ...;
  see ``CORE_KIND_GROUPS``) and is loaded by name, so selecting ``fsdp`` never imports
  another backend. A plugin adds kinds of its own (an agentic package's agents and tool
  sets) by declaring a ``ComponentKind`` in the ``miles.kinds`` group; ``kind_groups()``
  lists them all. Anywhere a name is accepted, an import path ``package.module:attr``
  is too (the colon is required).
* **pluggy decides how loaded code is called.** Hook modules registered under the
  ``miles.plugins`` group implement the ``miles_*`` hookspecs (``miles.hookspecs``).

Failures say which distribution and version, which entry point, and what to do: an
unknown name gets a "did you mean", two distributions claiming one name is an error
naming both, and a broken hook plugin is skipped with one warning (see
``build_plugin_manager``) but fails loudly when a run selects one of its components.
"""

from __future__ import annotations

from miles._plugins.components import load_component, make_component, validate_component_ref
from miles._plugins.discovery import CORE_KIND_GROUPS, HOOKS_GROUP, EntryPointInfo, kind_groups
from miles._plugins.kinds import KINDS_GROUP, ComponentKind
from miles._plugins.listing import PluginInfo, list_plugins
from miles._plugins.manager import (
    DISABLE_ENV,
    STRICT_ENV,
    BrokenPlugin,
    MilesPluginManager,
    build_plugin_manager,
    collect_config_sections,
    get_plugin_manager,
    reset_plugin_state,
)

__all__ = [
    "CORE_KIND_GROUPS",
    "DISABLE_ENV",
    "HOOKS_GROUP",
    "KINDS_GROUP",
    "STRICT_ENV",
    "BrokenPlugin",
    "ComponentKind",
    "EntryPointInfo",
    "MilesPluginManager",
    "PluginInfo",
    "build_plugin_manager",
    "collect_config_sections",
    "get_plugin_manager",
    "kind_groups",
    "list_plugins",
    "load_component",
    "make_component",
    "reset_plugin_state",
    "validate_component_ref",
]
