"""Resolve a component reference (an entry-point name or ``pkg.module:attr``) to an object.

stevedore's ``DriverManager`` does the loading: it compares names before importing,
so selecting ``length_penalty`` imports that one module and nothing else in the group.
Conflicts are checked on metadata first (before either claimant is imported); the
``conflict_resolver`` passed to stevedore is the same check, for the case where its
entry-point cache and our metadata index disagree.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic import ValidationError
from stevedore import DriverManager
from stevedore.exception import NoMatches
from stevedore.extension import Extension

from miles._plugins import discovery, hints
from miles._plugins.discovery import did_you_mean, group_for
from miles.errors import ComponentError, ConfigError, MilesError

if TYPE_CHECKING:
    from miles.interfaces import (
        AdvantageEstimator,
        Backend,
        Buffer,
        Correction,
        DataSource,
        EngineLauncher,
        EvalBackend,
        GenerateFn,
        GroupFilter,
        Loss,
        RolloutFn,
        Transport,
    )

# The kinds whose made component is a plain callable (checked by ``_CALLED_WITH`` where listed).
CallableKind = Literal["reward", "reward_postprocess", "filter"]

# The protocol each kind of component satisfies once made (rewards and filters are plain callables).
_PROTOCOLS: dict[str, str] = {
    "backend": "Backend",
    "transport": "Transport",
    "buffer": "Buffer",
    "loss": "Loss",
    "correction": "Correction",
    "advantage": "AdvantageEstimator",
    "rollout": "RolloutFn",
    "generate": "GenerateFn",
    "data_source": "DataSource",
    "engine": "EngineLauncher",
    "eval_backend": "EvalBackend",
}


# ``load_component`` returns what the name points at: for the function kinds that is the component
# itself (checked when it is made or called); for the others a class or a factory, so ``Any``.
@overload
def load_component(kind: Literal["generate"], ref: str) -> GenerateFn: ...
@overload
def load_component(kind: Literal["filter"], ref: str) -> GroupFilter: ...
@overload
def load_component(kind: str, ref: str) -> Any: ...
def load_component(kind: str, ref: str) -> Any:
    """The object that ``ref`` names among the ``kind`` components (a class, a function, ...).

    ``ref`` is an entry-point name in the kind's group (``length_penalty``) or an import
    path ``package.module:attr``. Raises ``ComponentError`` when the name is unknown,
    claimed by two distributions, or its module fails to import.
    """
    group = group_for(kind)
    _check_ref_type(kind, ref)
    if ":" in ref:
        return _import_path(kind, ref)
    entries = _named_entries(kind, group, ref)
    return _load_driver(kind, group, ref, entries)


# ``make_component`` is typed per kind: the result satisfies the kind's protocol (``_PROTOCOLS``,
# checked at runtime by ``_check_protocol``); other kinds (a plugin's own) are ``Any``.
@overload
def make_component(kind: Literal["backend"], ref: str, options: dict[str, Any] | None = None) -> Backend: ...
@overload
def make_component(
    kind: Literal["transport"], ref: str, options: dict[str, Any] | None = None
) -> Transport: ...
@overload
def make_component(kind: Literal["buffer"], ref: str, options: dict[str, Any] | None = None) -> Buffer: ...
@overload
def make_component(kind: Literal["loss"], ref: str, options: dict[str, Any] | None = None) -> Loss: ...
@overload
def make_component(
    kind: Literal["correction"], ref: str, options: dict[str, Any] | None = None
) -> Correction: ...
@overload
def make_component(
    kind: Literal["advantage"], ref: str, options: dict[str, Any] | None = None
) -> AdvantageEstimator: ...
@overload
def make_component(
    kind: Literal["rollout"], ref: str, options: dict[str, Any] | None = None
) -> RolloutFn: ...
@overload
def make_component(
    kind: Literal["generate"], ref: str, options: dict[str, Any] | None = None
) -> GenerateFn: ...
@overload
def make_component(
    kind: Literal["data_source"], ref: str, options: dict[str, Any] | None = None
) -> DataSource: ...
@overload
def make_component(
    kind: Literal["engine"], ref: str, options: dict[str, Any] | None = None
) -> EngineLauncher: ...
@overload
def make_component(
    kind: Literal["eval_backend"], ref: str, options: dict[str, Any] | None = None
) -> EvalBackend: ...
@overload
def make_component(
    kind: CallableKind, ref: str, options: dict[str, Any] | None = None
) -> Callable[..., Any]: ...
@overload
def make_component(kind: str, ref: str, options: dict[str, Any] | None = None) -> Any: ...
def make_component(kind: str, ref: str, options: dict[str, Any] | None = None) -> Any:
    """``load_component``, then a class is instantiated with ``**options``; other objects are returned as is.

    The result must satisfy the kind's protocol from ``miles.interfaces`` (rewards and
    filters must be callable).
    """
    obj = load_component(kind, ref)
    options = dict(options or {})
    if isinstance(obj, type):
        options = _validated_options(kind, ref, obj, options)
        _check_options(kind, ref, obj, options)
        try:
            made = obj(**options)
        except MilesError:
            raise
        except ValueError as err:  # includes pydantic's ValidationError: bad option values
            raise ComponentError(f"{kind} {ref!r} rejected its options {options}: {err}") from err
    elif options:
        raise ComponentError(
            f"{kind} {ref!r} is a {type(obj).__name__}, not a class, so it takes no options; "
            f"remove {', '.join(sorted(options))} from its options"
        )
    else:
        made = obj
    _check_protocol(kind, ref, made)
    return made


def validate_component_ref(kind: str, ref: str) -> None:
    """Check that ``ref`` can be resolved without importing it: the name is installed (and
    unique) and its module exists, or the import path's module can be found.

    Finding a module imports its parent packages (``importlib.util.find_spec``), never the
    module itself, so this is cheap even for a backend.
    """
    group = group_for(kind)
    _check_ref_type(kind, ref)
    if ":" in ref:
        module_name, _ = _split_import_path(kind, ref)
        _find_module(kind, ref, module_name)
        return
    entries = _named_entries(kind, group, ref)
    entry = entries[0]
    try:
        spec = importlib.util.find_spec(entry.module)
    except Exception as err:
        raise _import_failure(kind, ref, entry, err) from err
    if spec is None:
        raise ComponentError(
            f"{kind} {ref!r} from {entry.dist_label} points at module {entry.module!r}, which does not exist "
            f"(entry point {group}: {ref} = {entry.value}); reinstall {entry.distribution}"
        )


def error_on_conflict(namespace: str, name: str, extensions: list[Extension[Any]]) -> Extension[Any]:
    """stevedore ``conflict_resolver``: two entry points with one name is an error naming both distributions."""
    entries = [discovery.info_for(ext.entry_point) for ext in extensions]
    kind = "hook plugin" if namespace == discovery.HOOKS_GROUP else discovery.kind_for_group(namespace)
    raise ComponentError(discovery.conflict_message(f"{kind} {name!r}", entries))


# ------------------------------------------------------------------------------ names


def _check_ref_type(kind: str, ref: object) -> None:
    if not isinstance(ref, str) or not ref.strip():
        raise ComponentError(
            f"{kind} reference must be a non-empty string (a name or 'package.module:attr'), got {ref!r}"
        )


def _named_entries(kind: str, group: str, name: str) -> list[discovery.EntryPointInfo]:
    entries = discovery.providers(group, name)
    if not entries:
        raise ComponentError(_unknown_name_message(kind, group, name))
    if discovery.conflicting(entries):
        raise ComponentError(discovery.conflict_message(f"{kind} {name!r}", entries))
    return entries


def _unknown_name_message(kind: str, group: str, name: str) -> str:
    if "." in name:
        return (
            f"{kind} {name!r} is not an installed name, and import paths need a colon between the module "
            f"and the attribute: write {_colon_hint(name)!r}"
        )
    hint = hints.component_hint(kind, name)
    if hint is not None:  # a built-in name whose distribution is not installed (a bare miles-core)
        return hint
    installed = discovery.names(group)
    return (
        f"no {kind} named {name!r}{did_you_mean(name, installed) or '.'} "
        f"Installed ({group}): {discovery.describe_installed(group)}. "
        "A component can also be given as an import path 'package.module:attr'."
    )


def _colon_hint(dotted: str) -> str:
    module, _, attr = dotted.rpartition(".")
    return f"{module}:{attr}"


def _load_driver(kind: str, group: str, name: str, entries: list[discovery.EntryPointInfo]) -> Any:
    def on_load_failure(_manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        raise _import_failure(kind, name, discovery.info_for(ep), err) from err

    try:
        manager: DriverManager[Any] = DriverManager(
            group,
            name,
            on_load_failure_callback=on_load_failure,
            on_missing_entrypoints_callback=None,
            conflict_resolver=error_on_conflict,
        )
    except NoMatches:
        # Our metadata saw the name but stevedore's entry-point cache did not: stale cache.
        raise ComponentError(
            f"{kind} {name!r} is declared by {entries[0].dist_label} but stevedore's entry-point cache does "
            "not list it; delete ~/.cache/python-entrypoints and retry"
        ) from None
    return manager.driver


def _import_failure(
    kind: str, name: str, entry: discovery.EntryPointInfo, err: BaseException
) -> ComponentError:
    missing = hints.missing_library(err)
    return ComponentError(
        f"{kind} {name!r} from {entry.dist_label} failed to import "
        f"(entry point {entry.group}: {entry.name} = {entry.value}): {type(err).__name__}: {err}"
        + (f"; {missing}" if missing else "")
    )


# ----------------------------------------------------------------------- import paths


def _split_import_path(kind: str, ref: str) -> tuple[str, str]:
    module_name, _, attr = ref.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not module_name or not attr or ":" in attr:
        raise ComponentError(f"{kind} import path {ref!r} must look like 'package.module:attr'")
    return module_name, attr


def cwd_importable() -> None:
    """Make modules in the current directory importable by import path, as the docs promise.

    ``python -m miles`` puts the cwd on ``sys.path`` but the ``miles`` console script (and
    ``uv run miles``) does not. The cwd is *appended*, not inserted first: an installed
    package always wins over a same-named file that happens to lie in the cwd, so resolving
    one import path never changes which module another import finds. It stays on
    ``sys.path`` for the rest of the process on purpose: trainer ranks started with
    ``spawn``/``forkserver`` receive the parent's ``sys.path`` (and Ray actors are handed
    it), so they re-resolve the same ``mymod:attr`` from the same directory.
    """
    cwd = os.path.abspath(os.getcwd())
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == cwd:  # "" means the cwd too
            return
    sys.path.append(cwd)
    importlib.invalidate_caches()


def _find_module(kind: str, ref: str, module_name: str) -> None:
    cwd_importable()
    try:
        spec = importlib.util.find_spec(module_name)
    except ModuleNotFoundError as err:
        raise ComponentError(f"{kind} {ref!r}: cannot find module {module_name!r} ({err})") from err
    except Exception as err:
        raise ComponentError(
            f"{kind} {ref!r}: importing a parent package of {module_name!r} failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    if spec is None:
        raise ComponentError(
            f"{kind} {ref!r}: cannot find module {module_name!r} (searched the installed packages "
            f"and the current directory {os.getcwd()})"
        )


def _import_path(kind: str, ref: str) -> Any:
    module_name, attr_path = _split_import_path(kind, ref)
    _find_module(kind, ref, module_name)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        missing = hints.missing_library(err)
        raise ComponentError(
            f"{kind} {ref!r}: importing module {module_name!r} failed: {type(err).__name__}: {err}"
            + (f"; {missing}" if missing else "")
        ) from err
    owner = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise ComponentError(
                f"{kind} {ref!r}: {owner!r} has no attribute {part!r}{did_you_mean(part, public)}"
            )
        obj = getattr(obj, part)
        owner = f"{owner}.{part}"
    return obj


# -------------------------------------------------------------------------- checking


def _validated_options(kind: str, ref: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """A class that declares an options model is built with every field's validated value."""
    from miles.capabilities import options_model, takes_options_as_mapping

    if takes_options_as_mapping(kind):  # the model describes a mapping handed over whole, not the arguments
        return options
    model = options_model(cls, f"{kind} {ref!r}")
    if model is None:
        return options
    try:
        validated = model.model_validate(options)
    except ValidationError as err:
        from miles.config.options import describe_option_errors

        problems = describe_option_errors(err, model, f"{kind} {ref!r}", (), lambda path: None)
        raise ConfigError(f"{kind} {ref!r} rejected its options: " + "; ".join(problems)) from None
    return {
        **{name: getattr(validated, name) for name in type(validated).model_fields},
        **(validated.model_extra or {}),
    }


def _check_options(kind: str, ref: str, cls: type, options: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # some builtins and C classes have no signature: let the call decide
        return
    try:
        signature.bind(**options)
    except TypeError as err:
        accepted = [
            p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        takes = ", ".join(p.name for p in accepted) or "no options"
        raise ComponentError(
            f"{kind} {ref!r} ({cls.__module__}:{cls.__qualname__}) cannot take options "
            f"{sorted(options)}: {err}; it takes: {takes}"
        ) from None


def _check_protocol(kind: str, ref: str, obj: Any) -> None:
    protocol, protocol_label = _protocol_for(kind)
    if protocol is None:
        if not callable(obj):
            raise ComponentError(f"{kind} {ref!r} must be callable, got {type(obj).__name__}")
        _check_call_signature(kind, ref, obj)
        return
    if isinstance(obj, protocol):
        _check_call_signature(kind, ref, obj)
        return
    members = _protocol_members(protocol)
    missing = [m for m in members if not hasattr(obj, m)]
    raise ComponentError(
        f"{kind} {ref!r} ({type(obj).__module__}.{type(obj).__qualname__}) does not implement "
        f"{protocol_label}: missing {', '.join(missing) or 'members'}"
    )


def _protocol_for(kind: str) -> tuple[type | None, str]:
    """The Protocol a made ``kind`` component satisfies (``None``: a plain callable) and its dotted name."""
    name = _PROTOCOLS.get(kind)
    if name is not None:
        import miles.interfaces as interfaces  # plain dataclasses and Protocols: cheap

        return getattr(interfaces, name), f"miles.interfaces.{name}"
    declared = discovery.declared_kind(kind)
    if declared is None or declared.protocol is None:
        return None, ""
    module_name, _, attr = declared.protocol.partition(":")
    try:
        protocol = getattr(importlib.import_module(module_name), attr)
    except Exception as err:
        raise ComponentError(
            f"the {kind} kind's protocol {declared.protocol!r} does not load: {type(err).__name__}: {err}"
        ) from err
    return protocol, f"{module_name}.{attr}"


# The positional arguments the loop calls each callable kind with. A runtime-checkable
# Protocol only checks that ``__call__`` exists, so ``builtins:print`` would pass as a loss.
_CALLED_WITH: dict[str, tuple[str, ...]] = {
    "loss": ("inputs",),
    "advantage": ("groups",),
    "correction": ("old_logprobs", "rollout_logprobs", "loss_mask"),
    "reward": ("sample",),
    "reward_postprocess": ("sample", "reward"),
    "filter": ("group",),
}


def _check_call_signature(kind: str, ref: str, obj: Any) -> None:
    """Refuse a callable that cannot be called the way the loop calls a ``kind``: before the run, not mid-step."""
    args = _CALLED_WITH.get(kind)
    if args is None:
        declared = discovery.declared_kind(kind)
        args = declared.called_with if declared is not None and declared.called_with else None
    if args is None:
        return
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some C callables have no signature: nothing to check
        return
    call = f"{kind}({', '.join(args)})"
    params = list(signature.parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not named and any(p.kind is p.VAR_POSITIONAL for p in params):
        # Only ``*args`` (``print``): it accepts anything, so nothing says it is a {kind}.
        raise ComponentError(
            f"{kind} {ref!r} takes {signature} and declares no parameter for {', '.join(args)}; "
            f"a {kind} is called as {call}"
        )
    try:
        signature.bind(*args)
    except TypeError as err:
        raise ComponentError(
            f"{kind} {ref!r} takes {signature}, but a {kind} is called as {call}: {err}"
        ) from None


def _protocol_members(protocol: type) -> list[str]:
    body = vars(protocol)
    names = [n for n in body if not n.startswith("_") or n in ("__call__", "__len__")]
    names += [n for n in getattr(protocol, "__annotations__", {}) if n not in names]
    return names
