"""Rollout engines: the SGLang HTTP client, the embedded HF engine, and launchers.

Nothing heavy is imported here; ``miles.engines.embedded`` needs the ``engine`` extra.
"""
