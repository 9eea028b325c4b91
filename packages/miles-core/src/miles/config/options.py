"""Component options: each ``*_options`` mapping of a recipe checked against its component's model.

A component that takes options declares them as a pydantic model (``Options`` on a class, or
``miles.capabilities.declare_options``). :func:`check_component_options` validates every
options mapping the recipe gives against the model of the component it configures, and
reports each problem in one sentence naming the key, where it was set (``file:line`` or the
``--set`` that set it), the component and what is allowed; unknown keys are refused. A
component without a model keeps free-form options. ``miles config validate`` and the run's
pre-flight (``miles.driver.preflight``) call it before anything starts.

:func:`option_fields` describes a model's fields (name, type, default, description) for
``miles plugins --details`` and ``miles config schema``.
"""

from __future__ import annotations

import difflib
import inspect
import threading
import typing
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from miles.config.problems import KeyPath, Locate

if TYPE_CHECKING:
    from miles.config.schema import MilesConfig

# ------------------------------------------------------------------ where the recipe set things


@dataclass(frozen=True)
class RecipeOrigin:
    """Where a loaded config came from: the recipe's label and the place of each key it set."""

    label: str
    where: Mapping[KeyPath, str]

    def wrote(self, path: KeyPath) -> bool:
        """Whether the recipe (or a ``--set``) wrote ``path`` or a key below it."""
        return any(key[: len(path)] == path for key in self.where)

    def locate(self, path: KeyPath) -> str | None:
        for end in range(len(path), 0, -1):
            if path[:end] in self.where:
                return self.where[path[:end]]
        return None


_ORIGINS: dict[int, RecipeOrigin] = {}
_ORIGINS_LOCK = threading.Lock()


def remember_origin(config: object, origin: RecipeOrigin) -> None:
    """Keep ``origin`` for ``config`` as long as the config lives (``load_recipe`` calls this)."""
    key = id(config)
    with _ORIGINS_LOCK:
        _ORIGINS[key] = origin
    weakref.finalize(config, _forget, key, origin)


def _forget(key: int, origin: RecipeOrigin) -> None:
    with _ORIGINS_LOCK:
        if _ORIGINS.get(key) is origin:
            del _ORIGINS[key]


def origin_of(config: object) -> RecipeOrigin | None:
    with _ORIGINS_LOCK:
        return _ORIGINS.get(id(config))


# ------------------------------------------------------------------ the options of a recipe

# The core's kinds a recipe gives options to (``option_slots``); ``option_kinds()`` adds the kinds
# plugins declare (``miles.kinds``). The listing and the schema show their options.
CORE_OPTION_KINDS = (
    "data_source",
    "rollout",
    "generate",
    "reward",
    "reward_postprocess",
    "advantage",
    "loss",
    "correction",
    "transport",
    "engine",
    "eval_backend",
    "tracker",
)


def option_kinds() -> tuple[str, ...]:
    """Every kind a recipe gives options to: the core's, then each kind a plugin declares."""
    from miles._plugins.discovery import declared_kinds

    return (*CORE_OPTION_KINDS, *declared_kinds())


@dataclass(frozen=True)
class Owner:
    """A component configured by an options mapping: its recipe key, kind and reference."""

    key: KeyPath  # where the component is named (``("algorithm", "loss")``)
    kind: str
    ref: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.ref!r}"


@dataclass(frozen=True)
class OptionSlot:
    """One options mapping of the recipe and the component(s) that read it."""

    path: KeyPath  # ``("algorithm", "loss_options")``
    owners: tuple[Owner, ...]
    values: Mapping[str, Any]


def _key(dotted: str) -> KeyPath:
    out: list[str | int] = []
    for part in dotted.split("."):
        name, _, index = part.partition("[")
        out.append(name)
        if index:
            out.append(int(index.rstrip("]")))
    return tuple(out)


def option_slot(
    path: str, values: Mapping[str, Any], *owners: tuple[str, str, str | None]
) -> OptionSlot | None:
    """The slot of the options mapping at dotted ``path``, read by the ``(dotted key, kind, ref)``
    components that are named (a None ref: not selected); None when none is."""
    named = tuple(Owner(_key(key), kind, ref) for key, kind, ref in owners if ref is not None)
    return OptionSlot(_key(path), named, values) if named else None


def option_slots(config: MilesConfig) -> list[OptionSlot]:
    """Every options mapping ``config`` gives, with the components it configures (those the run uses):
    the core's sections', then those plugins report for theirs (``miles_option_slots``)."""
    from miles.plugins import get_plugin_manager, load_component

    def slot(path: str, values: Mapping[str, Any], *owners: tuple[str, str, str | None]) -> None:
        found = option_slot(path, values, *owners)
        if found is not None:
            slots.append(found)

    slots: list[OptionSlot] = []
    r, alg = config.rollout, config.algorithm
    slot("data.options", config.data.options, ("data.source", "data_source", config.data.source))
    if config.mode == "rl":
        slot(
            "rollout.options",
            r.options,
            ("rollout.fn", "rollout", r.fn),
            ("rollout.generate_fn", "generate", r.generate_fn),
        )
        slot("rollout.reward_options", r.reward_options, ("rollout.reward", "reward", r.reward))
        for i, name in enumerate(r.reward_postprocess):
            slot(
                f"rollout.reward_postprocess_options.{name}",
                r.reward_postprocess_options.get(name, {}),
                (f"rollout.reward_postprocess[{i}]", "reward_postprocess", name),
            )
        slot(
            "algorithm.advantage_options",
            alg.advantage_options,
            ("algorithm.advantage", "advantage", alg.advantage),
        )
        loss = alg.loss
        if loss is None:  # the estimator's own loss, when its class says which
            default = getattr(load_component("advantage", alg.advantage), "default_loss", None)
            loss = default if isinstance(default, str) else None
        slot(
            "algorithm.loss_options",
            alg.loss_options,
            ("algorithm.advantage" if alg.loss is None else "algorithm.loss", "loss", loss),
        )
        slot(
            "algorithm.correction_options",
            alg.correction_options,
            ("algorithm.correction", "correction", alg.correction),
        )
        if alg.critic is not None:
            slot(
                "algorithm.critic.loss_options",
                alg.critic.loss_options,
                ("algorithm.critic.loss", "loss", alg.critic.loss),
            )
        slot("weight_sync.options", config.weight_sync.options, ("transport", "transport", config.transport))
        slot("engine.options", config.engine.options, ("engine.launcher", "engine", config.engine.launcher))
    else:
        slot("algorithm.loss_options", alg.loss_options, ("algorithm.loss", "loss", alg.loss))
    ev = config.eval
    if ev is not None and (ev.reward is not None or ev.reward_options):  # else it uses rollout.reward_options
        slot(
            "eval.reward_options",
            ev.reward_options,
            ("eval.reward" if ev.reward else "rollout.reward", "reward", ev.reward or r.reward),
        )
        if ev.mode == "dedicated":
            slot(
                "eval.engine_options",
                ev.engine_options,
                ("engine.launcher", "engine", config.engine.launcher),
            )
        if ev.mode == "external":
            slot("eval.backend_options", ev.backend_options, ("eval.backend", "eval_backend", ev.backend))
    for contributed in get_plugin_manager().hook.miles_option_slots(config=config):
        for found in contributed or ():
            if not isinstance(found, OptionSlot):
                raise TypeError(f"miles_option_slots returned {found!r}; expected OptionSlot records")
            slots.append(found)
    slots.extend(tracker_slots(config))
    return slots


def tracker_slots(config: MilesConfig) -> list[OptionSlot]:
    """``tracking.options.<name>`` of each tracker the run uses (a name may be an import path, with
    dots: the key paths are built as tuples, not parsed)."""
    from miles.tracking.registry import SWITCHES, selected_trackers

    t = config.tracking
    out = []
    for name in selected_trackers(config):
        where: KeyPath = (
            ("tracking", name) if name in SWITCHES else ("tracking", "backends", t.backends.index(name))
        )
        out.append(
            OptionSlot(
                ("tracking", "options", name), (Owner(where, "tracker", name),), t.options.get(name, {})
            )
        )
    return out


def check_component_options(config: MilesConfig) -> None:
    """Validate every options mapping of ``config`` against its component's model (loads the components).

    Raises ``RecipeError`` with one sentence per problem, naming the key, where it was set,
    the component and what is allowed.
    """
    from miles.config.loader import RecipeError

    origin = origin_of(config)
    problems: list[str] = []
    for slot in option_slots(config):
        problems.extend(slot_problems(slot, origin))
    if problems:
        label = origin.label if origin is not None else repr(config.recipe or "config")
        raise RecipeError(label, problems)


def slot_problems(slot: OptionSlot, origin: RecipeOrigin | None) -> list[str]:
    from miles.capabilities import options_model
    from miles.plugins import load_component

    models: list[tuple[Owner, type[BaseModel] | None]] = []
    for owner in slot.owners:
        component = load_component(owner.kind, owner.ref)
        base = _static_base(component)
        if base is not None and set(slot.values) <= set(base.model_fields):
            # A model computed from what is installed (the embedded engine's adds its receivers'
            # options, which imports them) names the part it always has: enough for these keys,
            # and ``miles config validate`` stays fast.
            models.append((owner, base))
            continue
        models.append((owner, options_model(component, owner.label)))

    def locate(path: KeyPath) -> str | None:
        if origin is None:
            return None
        if origin.wrote(slot.path):  # the key itself, else the nearest enclosing key the recipe wrote
            return origin.locate(path)
        return origin.locate(slot.owners[0].key)  # a default mapping: where the component is named

    declared = [(owner, model) for owner, model in models if model is not None]
    if not declared:
        return []  # free-form options
    values = dict(slot.values)
    if len(models) == 1:
        owner, model = declared[0]
        return _validate(model, values, owner, slot.path, locate)
    # Several components read this mapping: each validates its own keys, and a key none of them
    # declares is refused only when every one has a model (a free-form reader may use it).
    problems: list[str] = []
    for owner, model in declared:
        mine = {k: v for k, v in values.items() if k in model.model_fields}
        problems.extend(_validate(model, mine, owner, slot.path, locate))
    if len(declared) == len(models) and all(_forbids_extra(m) for _, m in declared):
        known = sorted({name for _, m in declared for name in m.model_fields})
        readers = " and ".join(f"{'.'.join(map(str, o.key))} {o.ref!r}" for o, _ in declared)
        for name in values:
            if name not in known:
                path = (*slot.path, name)
                problems.append(
                    f"unknown key {_dotted(path)!r}{_at(locate(path))}: none of {readers} takes option {name!r}"
                    f"{_did_you_mean(name, known)}; allowed: {', '.join(known) or 'no options'}"
                )
    return problems


def _static_base(component: object) -> type[BaseModel] | None:
    """``base`` of a computed ``Options`` (a descriptor): the fields it has whatever is installed."""
    static = inspect.getattr_static(component, "Options", None)
    if static is None or isinstance(static, type):
        return None
    base = getattr(static, "base", None)
    return base if isinstance(base, type) and issubclass(base, BaseModel) else None


def _forbids_extra(model: type[BaseModel]) -> bool:
    return model.model_config.get("extra") == "forbid"


def _validate(
    model: type[BaseModel], values: dict[str, Any], owner: Owner, prefix: KeyPath, locate: Locate
) -> list[str]:
    try:
        model.model_validate(values)
    except ValidationError as exc:
        return describe_option_errors(exc, model, owner.label, prefix, locate)
    return []


def describe_option_errors(
    exc: ValidationError, model: type[BaseModel], component: str, prefix: KeyPath, locate: Locate
) -> list[str]:
    """One sentence per error of validating ``component``'s options (at ``prefix``) against ``model``.

    A value that matches no member of a union is one problem (pydantic reports one per member).
    """
    from miles.config.problems import user_path

    grouped: dict[KeyPath, list[Any]] = {}
    for error in exc.errors(include_url=False):
        loc, _ = user_path(model, tuple(error["loc"]))
        grouped.setdefault(loc, []).append(error)
    allowed = ", ".join(model.model_fields) or "no options"
    problems: list[str] = []
    for loc, errors in grouped.items():
        error = errors[0]
        path = (*prefix, *loc)
        at = _at(locate(path))
        name = str(loc[0]) if loc else ""
        field = model.model_fields.get(name)
        kind = error["type"]
        if kind == "extra_forbidden":
            message = (
                f"unknown key {_dotted(path)!r}{at}: {component} has no option {name!r}"
                f"{_did_you_mean(name, list(model.model_fields))}; allowed: {allowed}"
            )
        elif kind == "missing":
            about = f" ({field.description})" if field is not None and field.description else ""
            message = f"missing key {_dotted(path)!r}{at}: {component} needs option {name!r}{about}"
        else:
            typed = f" ({type_text(field.annotation)})" if field is not None else ""
            if len(errors) > 1:  # no member of a union took it
                reason = (
                    f"must be {type_text(field.annotation)}"
                    if field is not None and len(loc) == 1
                    else ("matches none of the allowed types")
                )
            else:
                reason = str(error["msg"]).removeprefix("Value error, ")
                if reason.startswith("Input should be "):
                    reason = "must be " + reason.removeprefix("Input should be ")
            message = f"{_dotted(path)}{at}: got {_show(error.get('input'))}; option {name!r}{typed} of {component} {reason}"
        problems.append(message)
    return problems


def _dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _at(where: str | None) -> str:
    return f" ({where})" if where else ""


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------ describing a model


@dataclass(frozen=True)
class OptionField:
    """One option as listed: name, type, default (``required`` when it has none) and description."""

    name: str
    type: str
    default: str
    description: str

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "type": self.type,
            "default": self.default,
            "description": self.description,
        }


def type_text(annotation: Any) -> str:
    """A short readable type: ``float``, ``str | None``, ``Literal['k1', 'k2']``, ``list[str]``."""
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None and str(origin) in ("typing.Union", "<class 'types.UnionType'>"):
        return " | ".join(type_text(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and origin is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("collections.abc.", "")


def option_fields(model: type[BaseModel]) -> list[OptionField]:
    fields = []
    for name, field in model.model_fields.items():
        if field.is_required():
            default = "required"
        elif field.default_factory is not None:
            default = repr(field.default_factory())  # type: ignore[call-arg]
        else:
            default = repr(field.default) if field.default is not PydanticUndefined else "required"
        fields.append(OptionField(name, type_text(field.annotation), default, field.description or ""))
    if model.model_config.get("extra") == "allow":
        about = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        fields.append(OptionField("*", "any", "", f"other keys are accepted: {about}".rstrip(": ")))
    return fields


def component_options_schema(kind: str, ref: str) -> dict[str, Any] | None:
    """The JSON schema of the options model of ``kind`` component ``ref``; None without a model."""
    from miles.capabilities import options_model
    from miles.plugins import load_component

    model = options_model(load_component(kind, ref), f"{kind} {ref!r}")
    return None if model is None else model.model_json_schema()


__all__ = [
    "CORE_OPTION_KINDS",
    "OptionField",
    "OptionSlot",
    "RecipeOrigin",
    "check_component_options",
    "component_options_schema",
    "describe_option_errors",
    "option_fields",
    "option_kinds",
    "option_slots",
    "origin_of",
    "remember_origin",
    "type_text",
]
