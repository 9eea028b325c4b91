"""Reading recipe YAML: where each key is, duplicates refused, and numbers read as numbers.

PyYAML follows YAML 1.1, where ``1e-5`` (no dot) is a *string* and ``2024-01-01`` a date;
in a recipe both are surprises, so this loader reads exponent floats as floats and
leaves dates as strings. Files and ``--set`` values go through the same loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from miles.errors import ConfigError

KeyPath = tuple[str | int, ...]

_MERGE_TAG = "tag:yaml.org,2002:merge"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys and reads ``1e-5`` as a float."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it properly
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first set on line {first + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _TIMESTAMP_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class ParsedYaml:
    data: Any
    lines: dict[KeyPath, int]  # key path -> 1-based line where that key (or list item) starts


def parse_yaml(text: str, source: str) -> ParsedYaml:
    """Parse one YAML document; malformed input is a ``ConfigError`` naming ``source:line:column``."""
    loader = RecipeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as err:
        raise ConfigError(_describe_yaml_error(err, source)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: malformed YAML: {err}") from None
    finally:
        loader.dispose()
    lines: dict[KeyPath, int] = {}
    if node is not None:
        _record_lines(node, (), lines)
    return ParsedYaml(data, lines)


def parse_value(raw: str) -> Any:
    """A ``--set`` value: a YAML scalar, list or mapping (``0.5``, ``null``, ``[a, b]``, ``{k: 1}``).

    Text that is not a flow list/mapping or a quoted string is read as one plain scalar,
    so ``Q: {prompt}`` stays a string and a ``#`` is kept rather than starting a comment.
    """
    text = raw.strip()
    if text[:1] in ("[", "{", "'", '"'):
        try:
            return yaml.load(text, Loader=RecipeLoader)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(f"value {raw!r} is not valid YAML: {problem}") from None
    loader = RecipeLoader("")
    try:
        tag = loader.resolve(ScalarNode, text, (True, False))
        return loader.construct_document(ScalarNode(tag, text))
    finally:
        loader.dispose()


def _describe_yaml_error(err: yaml.MarkedYAMLError, source: str) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = err.problem or "malformed YAML"
    context = ""
    if err.context:
        started = err.context_mark
        at = f" started on line {started.line + 1}" if started is not None and started is not mark else ""
        context = f" ({err.context}{at})"
    return f"{where}: malformed YAML: {problem}{context}"


def _record_lines(node: Any, prefix: KeyPath, out: dict[KeyPath, int]) -> None:
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode):
                path = (*prefix, key_node.value)
                out[path] = key_node.start_mark.line + 1
                _record_lines(value_node, path, out)
    elif isinstance(node, SequenceNode):
        for index, item in enumerate(node.value):
            path = (*prefix, index)
            out[path] = item.start_mark.line + 1
            _record_lines(item, path, out)


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
