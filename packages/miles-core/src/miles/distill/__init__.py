"""On-policy distillation: teachers that score the student's own trajectories.

- :mod:`miles.distill.topk`: the top-K reverse-KL estimate (pure functions).
- :mod:`miles.distill.served`: :class:`ServedTeacher`, a rollout-time scorer that asks served
  engines (SGLang or embedded) for the teacher's log-probs, and :func:`check_same_tokenizer`.

The in-process teacher (scored on the trainer) and the folding of the signal into the
advantages live with the trainer side (``miles.builtins.algorithms.opd``).

The served side is imported on first use, so ``import miles.distill.topk`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from miles.distill.topk import CANDIDATES, reverse_kl_at, reverse_kl_sequence

_SERVED = ("DEFAULT_TEACHER", "OPD_REVERSE_KL", "ServedTeacher", "check_same_tokenizer", "tokenizer_probe")


def __getattr__(name: str) -> Any:
    if name in _SERVED:
        from miles.distill import served

        return getattr(served, name)
    raise AttributeError(f"module 'miles.distill' has no attribute {name!r}")


__all__ = ["CANDIDATES", "reverse_kl_at", "reverse_kl_sequence", *_SERVED]
