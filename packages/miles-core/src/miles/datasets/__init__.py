"""Datasets shipped with Miles, named ``builtin:NAME`` in a recipe's ``data.path``.

``arith.jsonl``: every single-digit addition whose sum is a single digit ("3+4=" → "7"),
written by ``scripts/make_arith_dataset.py``. The default recipe trains the tiny model on it.
"""
