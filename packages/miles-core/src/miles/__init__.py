"""Miles: a post-training system for large language models.

``import miles`` is cheap on purpose (no torch): the CLI, config validation and
plugin listing run without a tensor library.
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

hookimpl = pluggy.HookimplMarker("miles")

try:
    __version__ = version("miles-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = ["__version__", "hookimpl"]
