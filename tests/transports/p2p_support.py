"""Whether Mooncake's transfer engine (the P2P transport's bytes) can be imported here, and the
marker that skips a test that needs it, with the reason.

``import mooncake.engine`` fails in two ways: the package is not installed (ModuleNotFoundError), or
it is installed but a system library it links against is missing (a plain ImportError, e.g.
``libibverbs.so.1: cannot open shared object file``; only ``.ci/run`` installs libibverbs). Both
mean "no P2P here", so both skip; ``pytest.importorskip`` would skip only the first.
"""

from __future__ import annotations

import pytest

try:
    import mooncake.engine  # noqa: F401

    MOONCAKE_ERROR = ""
except ImportError as exc:
    MOONCAKE_ERROR = f"{type(exc).__name__}: {exc}"

needs_mooncake = pytest.mark.skipif(
    bool(MOONCAKE_ERROR),
    reason=f"Mooncake is not importable ({MOONCAKE_ERROR}); install miles-transports[p2p] "
    "(and libibverbs1, which .ci/run installs) to run P2P transfers",
)
