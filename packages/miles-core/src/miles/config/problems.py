"""Turn pydantic's validation errors into one plain sentence per problem.

Each sentence names the dotted key, where it was set (``file:line`` or the ``--set``
that set it), the value given and what is allowed: "did you mean" for unknown keys
(against the fields of the section they were found in), the choices for a ``Literal``.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

KeyPath = tuple[str | int, ...]
Locate = Callable[[KeyPath], str | None]


def describe_errors(exc: ValidationError, model: type[BaseModel], locate: Locate) -> list[str]:
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        message = _describe(error, model, locate)
        if message not in problems:  # a union can report one cause once per member
            problems.append(message)
    return problems


def user_path(root: type[BaseModel], loc: KeyPath) -> tuple[KeyPath, type[BaseModel] | None]:
    """The key path a user wrote for pydantic's ``loc`` (union-member tags dropped), and the
    model owning its last key."""
    return _walk(root, loc)


def _describe(error: Any, root: type[BaseModel], locate: Locate) -> str:
    path, owner = _walk(root, tuple(error["loc"]))
    key = ".".join(str(p) for p in path)
    where = locate(path) if path else None
    at = f" ({where})" if where else ""
    label = f"{key}{at}"
    kind = error["type"]
    value = error.get("input")
    message = str(error["msg"])

    if kind == "extra_forbidden":
        name = str(path[-1])
        prefix = ".".join(str(p) for p in path[:-1])
        fields = _public_fields(owner) if owner is not None else []
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        section = f"in {prefix}" if prefix else "at the top level"
        if not prefix:
            from miles._plugins.hints import section_hint

            hint = section_hint(name)
            if hint is not None:  # a plugin's section, and that plugin is not installed
                return f"key {key!r}{at} {hint}"
        if close:
            guess = f"{prefix}.{close[0]}" if prefix else close[0]
            return f"unknown key {key!r}{at}; did you mean {guess!r}?"
        return f"unknown key {key!r}{at}; allowed {section}: {', '.join(fields)}"
    if kind == "missing":
        description = _field_description(owner, str(path[-1])) if path else None
        about = f" ({description})" if description else ""
        return f"missing required key {key!r}{at}{about}"
    if kind.startswith("literal_error"):
        expected = (error.get("ctx") or {}).get("expected", "")
        return f"{label}: got {_show(value)}; allowed: {expected}"
    if kind in ("value_error", "assertion_error") and isinstance(value, dict):
        # A model-level check (cross-field rule): the input is the whole section, not worth printing.
        reason = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{key}: {reason}" if key else reason
    reason = message.removeprefix("Value error, ")
    if reason.startswith("Input should be "):
        reason = "must be " + reason.removeprefix("Input should be ")
    return f"{label}: got {_show(value)}; {reason}"


def _walk(root: type[BaseModel], loc: KeyPath) -> tuple[KeyPath, type[BaseModel] | None]:
    """Keep the parts of ``loc`` a user would write (field names, dict keys, list indices),
    dropping pydantic's union-member tags; also return the model owning the last key."""
    path: list[str | int] = []
    current: Any = root
    owner: type[BaseModel] | None = root
    for part in loc:
        current = _unwrap_optional(current)  # ``X | None`` validates as X: no union tag in ``loc``
        model = _as_model(current)
        if model is not None:
            owner = model
            path.append(part)
            field = model.model_fields.get(part) if isinstance(part, str) else None
            current = field.annotation if field is not None else None
        elif isinstance(part, int) or _is_mapping(current):
            path.append(part)
            current = _item_type(current, part)
        # else: a union tag such as 'str' or 'function-after[...]'; not part of the key
    return tuple(path), owner


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _as_model(members[0])
    return None


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, dict)


def _item_type(annotation: Any, part: str | int) -> Any:
    args = typing.get_args(annotation)
    if not args:
        return None
    if _is_mapping(annotation):
        return args[-1]
    if typing.get_origin(annotation) is tuple and isinstance(part, int):
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[part] if part < len(args) else None
    return args[0]


def _public_fields(model: type[BaseModel]) -> list[str]:
    return [name for name in model.model_fields if name != "recipe"]


def _field_description(model: type[BaseModel] | None, name: str) -> str | None:
    if model is None or name not in model.model_fields:
        return None
    return model.model_fields[name].description


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
