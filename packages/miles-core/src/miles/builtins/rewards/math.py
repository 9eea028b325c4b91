"""A math answer checker: 1.0 when the response's final answer equals the label, else 0.0.

The final answer is the content of the last ``\\boxed{...}`` if there is one, else the
last number in the response, outside its ``<think>`` reasoning (``reasoning.strip_reasoning``). Two answers match when their normalized text is equal,
when they are the same number (``0.5`` = ``1/2`` = ``\\frac{1}{2}``, ``1,000`` = ``1000``;
compared as exact fractions), or, when sympy is installed, when their difference
simplifies to zero (``2\\sqrt{2}`` = ``\\sqrt{8}``). Model output is untrusted: only a
whitelisted, size-bounded subset of expressions ever reaches sympy.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from miles.builtins.rewards.labels import require_label
from miles.builtins.rewards.reasoning import strip_reasoning
from miles.types import Sample

# A number not glued to a word or a decimal point; "8-5" yields 8 and 5, "x=-3" yields -3.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
_RATIO = re.compile(r"^([+-]?\d+(?:\.\d+)?)/([+-]?\d+(?:\.\d+)?)$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*=(?!=)")

MAX_SYMBOLIC_LENGTH = 200
_FUNCTIONS = {"sqrt", "root", "pi", "sin", "cos", "tan", "log", "ln", "exp"}


def math_reward(sample: Sample) -> float:
    """Score ``sample.response_text`` against ``sample.prompt.label``."""
    label = require_label(sample, "math")
    predicted = extract_answer(sample.response_text)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, reference_answer(label)) else 0.0


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` content, else the last number, else None; reasoning is never read."""
    text = strip_reasoning(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(label: str) -> str:
    """A label may itself be a worked solution: take its boxed answer or what follows ``####`` (GSM8K)."""
    boxed = last_boxed(label)
    if boxed is not None:
        return boxed
    if "####" in label:
        return label.rsplit("####", 1)[1]
    return label


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (or ``\\boxed 5``)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" "):
        token = rest.strip().split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


def normalize(answer: str) -> str:
    s = answer.strip()
    for wrapper in ("\\text", "\\textbf", "\\mathrm", "\\mathbf"):
        s = re.sub(re.escape(wrapper) + r"\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = brace_arguments(s)  # \frac12 -> \frac{1}{2}, 2\sqrt3 -> 2\sqrt{3}
    for noise in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\ ",
        "\\$",
        "$",
        "\\%",
        "%",
        "^\\circ",
        "^{\\circ}",
        "\\circ",
    ):
        s = s.replace(noise, "")
    s = re.sub(r"\s+", "", s)
    s = _ASSIGNMENT.sub("", s)  # "x=5" -> "5"
    return s.rstrip(".")


# The commands whose arguments may be written without braces; how many mandatory arguments each has.
_ARGUMENT_COUNTS = {"frac": 2, "sqrt": 1}
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
_TOKEN_COMMAND = re.compile(r"\\(?:[a-zA-Z]+|.)", re.DOTALL)  # a control word or symbol (\pi, \%)


def brace_arguments(s: str) -> str:
    """Brace every argument of ``\\frac`` and ``\\sqrt``, as LaTeX reads them.

    Without braces, LaTeX takes one token per argument: a character or a command, so
    ``\\frac12`` is ``\\frac{1}{2}``, ``\\frac\\pi2`` is ``\\frac{\\pi}{2}``, ``2\\sqrt3`` is
    ``2\\sqrt{3}`` and ``\\sqrt 12`` is ``\\sqrt{1}2`` (what it renders). Models write both forms,
    and the comparisons below (text, ``\\frac`` numbers, sympy) understand only braced arguments.
    """
    out: list[str] = []
    i = 0
    while i < len(s):
        m = _COMMAND.match(s, i)
        if m is None:
            out.append(s[i])
            i += 1
            continue
        out.append(m.group())
        i = m.end()
        count = _ARGUMENT_COUNTS.get(m.group(1))
        if count is None:
            continue
        if m.group(1) == "sqrt":
            i = _skip_spaces(s, i)
            if i < len(s) and s[i] == "[":  # \sqrt[3]{x}: the optional index stays as written
                close = s.find("]", i)
                if close < 0:
                    break
                out.append(brace_arguments(s[i : close + 1]))
                i = close + 1
        for _ in range(count):
            argument, i = _argument(s, i)
            if argument is None:
                break
            out.append("{" + brace_arguments(argument) + "}")
    out.append(s[i:])
    return "".join(out)


def _skip_spaces(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _argument(s: str, i: int) -> tuple[str | None, int]:
    """The argument starting at ``s[i]`` (a braced group's content, a command or one character) and
    the index after it; ``(None, i)`` when there is none (the text ends, or an unbalanced group)."""
    i = _skip_spaces(s, i)
    if i >= len(s) or s[i] == "}":
        return None, i
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    return s[i + 1 : j], j + 1
        return None, i
    if m := _TOKEN_COMMAND.match(s, i):
        return m.group(), m.end()
    return s[i], i + 1


def to_number(s: str) -> Fraction | None:
    """Exact value of a plain, thousands-separated, fractional or ``\\frac`` number; None otherwise."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        if _DECIMAL.match(s):
            return Fraction(s)
        if m := _RATIO.match(s):
            num, den = Fraction(m.group(1)), Fraction(m.group(2))
            return num / den if den else None
        if m := _FRAC.match(s):
            top, bottom = to_number(m.group(2)), to_number(m.group(3))
            if top is None or not bottom:
                return None
            return -top / bottom if m.group(1) == "-" else top / bottom
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def answers_match(predicted: str, reference: str) -> bool:
    a, b = normalize(predicted), normalize(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return x == y
    return symbolic_equal(a, b)


def symbolic_equal(a: str, b: str) -> bool:
    """True if sympy (when installed) proves ``a - b == 0``; False on anything it cannot parse safely."""
    try:
        import sympy
    except ImportError:
        return False
    left, right = _to_sympy(a, sympy), _to_sympy(b, sympy)
    if left is None or right is None:
        return False
    try:
        return bool(sympy.simplify(left - right) == 0)
    except Exception:  # sympy raises a wide range of errors on odd input; not equal then
        return False


def _latex_to_infix(s: str) -> str | None:
    if len(s) > MAX_SYMBOLIC_LENGTH:
        return None
    frac = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
    sqrt_n = re.compile(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}")
    sqrt = re.compile(r"\\sqrt\{([^{}]*)\}")
    for _ in range(20):  # innermost first, a bounded number of times
        new = frac.sub(r"((\1)/(\2))", s)
        new = sqrt_n.sub(r"root(\2,\1)", new)
        new = sqrt.sub(r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\pi", "pi")
    s = s.replace("\\ln", "ln").replace("\\log", "log").replace("\\sin", "sin").replace("\\cos", "cos")
    s = (
        s.replace("\\tan", "tan")
        .replace("\\exp", "exp")
        .replace("{", "(")
        .replace("}", ")")
        .replace("^", "**")
    )
    if re.fullmatch(r"[0-9a-zA-Z+\-*/().,]*", s) is None:
        return None  # a leftover LaTeX command, or anything else we do not interpret
    if re.search(r"\.(?!\d)|(?<=[a-zA-Z)])\.", s):
        return None  # a dot outside a decimal number would be attribute access
    if any(len(name) > 1 and name not in _FUNCTIONS for name in re.findall(r"[a-zA-Z]+", s)):
        return None  # only single-letter variables and the whitelisted functions are names
    return s


def _to_sympy(s: str, sympy: Any) -> Any | None:
    infix = _latex_to_infix(s)
    if infix is None:
        return None
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    # Every name the expression may use is bound here, so parsing cannot reach anything else.
    local: dict[str, Any] = {
        c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    }
    local.update(
        sqrt=sympy.sqrt,
        root=sympy.root,
        pi=sympy.pi,
        sin=sympy.sin,
        cos=sympy.cos,
        tan=sympy.tan,
        log=sympy.log,
        ln=sympy.log,
        exp=sympy.exp,
    )
    transformations = (*standard_transformations, implicit_multiplication_application)
    try:
        expr = parse_expr(infix, local_dict=local, transformations=transformations, evaluate=False)
    except Exception:  # SyntaxError, TokenError, TypeError...: not an expression we understand
        return None
    return expr if _bounded(expr, sympy) else None


def _bounded(expr: Any, sympy: Any) -> bool:
    """Reject expressions whose evaluation could explode (huge integers, towers of powers)."""
    limit = 10**50
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Rational) and (abs(node.p) > limit or node.q > limit):
            return False
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if exponent.is_Number:
                if abs(exponent) > 64:
                    return False
            elif exponent.atoms(sympy.Pow) or not exponent.free_symbols:
                return False  # a tower of powers, or a numeric exponent hidden in an expression
    return True
