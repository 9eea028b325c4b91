"""What to ``pip install`` when a built-in name or a library is missing: the one table that knows.

A bare ``pip install miles-core`` has no backend, no transport and no torch. The core
must not import plugin packages (or even know their modules), so this is plain data:
which distribution and which ``miles-core`` extra provide each built-in component name,
recipe section and third-party library that lives outside the bare install. Keep it in
step with the ``[project.optional-dependencies]`` of ``packages/miles-core/pyproject.toml``
(a test reads that file and checks every extra named here exists).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Provider:
    """An installable that brings something: ``pip install 'miles-core[EXTRA]'`` installs ``distribution``."""

    extra: str
    distribution: str | None = None  # None: a third-party library the extra depends on

    @property
    def command(self) -> str:
        return f"pip install 'miles-core[{self.extra}]'"


_FSDP = Provider("fsdp", "miles-fsdp")
_TRANSPORTS = Provider("transports", "miles-transports")
_ENGINE = Provider("engine")
_ENVS = Provider("envs", "miles-envs")

# (kind, name) -> who provides it, for the built-in names that ship outside miles-core.
COMPONENTS: dict[tuple[str, str], Provider] = {
    ("backend", "fsdp"): _FSDP,
    ("transport", "broadcast"): _TRANSPORTS,
    ("transport", "colocated"): _TRANSPORTS,
    ("transport", "disk-delta"): _TRANSPORTS,
    ("transport", "p2p"): _TRANSPORTS,
    **{
        key: _ENVS
        for key in (
            ("generate", "multi_turn"),
            ("generate", "agentic"),
            ("reward", "agent"),
        )
    },
}

# Component kinds that a plugin declares (``miles.kinds``), for when that plugin is absent.
KINDS: dict[str, Provider] = dict.fromkeys(("agent", "toolset", "session_matcher"), _ENVS)

# Top-level recipe sections that a plugin contributes (``miles_config_sections``).
SECTIONS: dict[str, Provider] = {"fsdp": _FSDP, "agentic": _ENVS}

# Top-level import name -> the extra whose dependencies bring it.
LIBRARIES: dict[str, Provider] = {
    **dict.fromkeys(
        ("torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "jinja2"), _ENGINE
    ),
    **dict.fromkeys(("xxhash", "zstandard", "orjson"), _ENGINE),
    "tensorboard": Provider("tracking"),
    "pyarrow": Provider("parquet"),
    "datasets": Provider("datasets"),
    "ray": Provider("ray"),
    "openai": _ENVS,
    "sglang": Provider("sglang"),
    "megatron": Provider("megatron", "miles-megatron"),
    "miles_fsdp": _FSDP,
    "miles_transports": _TRANSPORTS,
    "miles_envs": _ENVS,
}


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def component_hint(kind: str, name: str) -> str | None:
    """``backend 'fsdp' is not installed: pip install ...`` when a known provider is absent, else None.

    None also when the provider is installed: then the name is really unknown (or stale
    metadata), and the generic "no backend named ..." message is the right one.
    """
    provider = COMPONENTS.get((kind, name))
    if provider is None or provider.distribution is None or _installed(provider.distribution):
        return None
    return f"{kind} {name!r} is not installed: {provider.command} (provides it: {provider.distribution})"


def kind_hint(kind: str) -> str | None:
    """Why the component kind ``kind`` is unknown, when a known plugin that is absent declares it."""
    provider = KINDS.get(kind)
    if provider is None or provider.distribution is None or _installed(provider.distribution):
        return None
    return f"component kind {kind!r} is declared by {provider.distribution}, which is not installed: {provider.command}"


def section_hint(name: str) -> str | None:
    """Why the top-level recipe key ``name`` is unknown, when a known plugin that is absent owns it."""
    provider = SECTIONS.get(name)
    if provider is None or provider.distribution is None or _installed(provider.distribution):
        return None
    return f"is the config section of {provider.distribution}, which is not installed: {provider.command}"


def missing_library(err: BaseException) -> str | None:
    """``this needs torch, which is not installed: pip install ...`` for an ImportError of a known
    optional library that is really absent (not one that is installed but fails inside), else None."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    top = err.name.partition(".")[0]
    provider = LIBRARIES.get(top)
    if provider is None:
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None  # installed: a submodule or a dependency of it is what is missing
    except (ImportError, ValueError):
        pass
    return f"this needs {top}, which is not installed: {provider.command}"
