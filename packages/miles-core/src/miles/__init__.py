"""Miles: a post-training system for large language models.

``import miles`` is cheap on purpose (no torch, not even pluggy or importlib.metadata until
``hookimpl`` or ``__version__`` is first used): the CLI's help, config validation and plugin
listing run without a tensor library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

    hookimpl: pluggy.HookimplMarker
    __version__: str

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # Module-level lazy attributes (PEP 562): resolved once, then cached in the module's namespace.
    if name == "hookimpl":
        import pluggy

        value: Any = pluggy.HookimplMarker("miles")
    elif name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("miles-core")
        except PackageNotFoundError:  # pragma: no cover - a source tree without install
            value = "0.0.0"
    else:
        raise AttributeError(f"module 'miles' has no attribute {name!r}")
    globals()[name] = value
    return value
