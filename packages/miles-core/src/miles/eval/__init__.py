"""Asynchronous evaluation (shared engines, a dedicated fleet, or an external backend); see ``evaluator``."""

from miles.eval.evaluator import Evaluator
from miles.eval.result import SKIP_REASONS, EvalResult, EvalSkipped

__all__ = ["SKIP_REASONS", "EvalResult", "EvalSkipped", "Evaluator"]
