"""Built-in tool sets for multi-turn episodes, and running a reply's tool calls.

``calculator``: one tool, ``calculator(expression)``, which evaluates integer and decimal
arithmetic (``+ - * / // % **`` and parentheses). It parses the expression with :mod:`ast`
and walks only number and operator nodes, so nothing the model writes is ever executed as
code; exponents and operand sizes are bounded so a reply cannot make it compute for long.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from miles.capabilities import NoOptions
from miles.errors import ToolError
from miles_envs.interfaces import ToolSet

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ToolError`` for anything else."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise ToolError(str(exc)) from None
    raise ToolError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ToolError("the result is out of range")
    return value


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class Calculator:
    """The ``calculator`` tool set (see the module docstring)."""

    Options = NoOptions  # agentic.tools_options: it takes none

    SPEC: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return its value.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                "required": ["expression"],
            },
        },
    }

    def specs(self) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(self.SPEC))]  # a copy the caller may change

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "calculator":
            raise ToolError(f"unknown tool {name!r}; available: calculator")
        unexpected = sorted(set(arguments) - {"expression"})
        if unexpected or "expression" not in arguments:
            raise ToolError(f"calculator takes one argument, expression (got {sorted(arguments)})")
        return _format(evaluate_arithmetic(arguments["expression"]))


async def run_tool_calls(toolset: ToolSet, tool_calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tool messages answering an assistant's ``tool_calls`` (OpenAI shape), in order.

    A ``ToolError`` becomes the tool message's content (``"error: ..."``), as a real tool's
    error output would; any other exception propagates (the tool set is broken).
    """
    messages = []
    for call in tool_calls:
        function = call.get("function", {})
        name = function.get("name", "")
        raw = function.get("arguments", "{}")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
            if not isinstance(arguments, dict):
                raise ToolError("tool arguments must be a JSON object")
            content = await toolset.call(name, arguments)
        except (ToolError, json.JSONDecodeError) as exc:
            content = f"error: {exc}"
        message = {"role": "tool", "content": str(content)}
        if call.get("id"):
            message["tool_call_id"] = call["id"]
        messages.append(message)
    return messages
