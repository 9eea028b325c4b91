"""Models Miles can name without a model hub: tiny built-in checkpoints and an offline SmolLM2.

``resolve_model("builtin:tiny-qwen3")`` builds into the cache on first use and returns
the folder; ``miles models list`` / ``miles models build NAME`` do the same from the CLI.
"""

from miles.models.registry import BUILTIN_MODELS, build_model, check_model_dir, resolve_model

__all__ = ["BUILTIN_MODELS", "build_model", "check_model_dir", "resolve_model"]
