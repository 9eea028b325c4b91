"""Sandboxes: where an agent's untrusted commands run (the contract in :mod:`miles_envs.sandbox.base`)."""

from miles_envs.sandbox.base import (
    ExecReason,
    ExecResult,
    IsolationReport,
    IsolationUnavailableError,
    PathEscapeError,
    Sandbox,
    SandboxError,
    SandboxHealth,
    SandboxLimits,
    SandboxProvider,
    SandboxSpec,
)
from miles_envs.sandbox.registry import PROVIDERS_GROUP, make_provider, provider_names

__all__ = [
    "PROVIDERS_GROUP",
    "ExecReason",
    "ExecResult",
    "IsolationReport",
    "IsolationUnavailableError",
    "PathEscapeError",
    "Sandbox",
    "SandboxError",
    "SandboxHealth",
    "SandboxLimits",
    "SandboxProvider",
    "SandboxSpec",
    "make_provider",
    "provider_names",
]
