"""Built-in rewards: ``exact_match``, ``math`` and ``reasoning_gym``."""
