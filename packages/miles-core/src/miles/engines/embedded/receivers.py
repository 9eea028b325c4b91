"""Engine-side receivers: how a transport distribution adds its endpoints to the embedded engine.

A transport talks to an engine-side receiver it names in ``TransportNeeds.receiver``. The
embedded engine has two receivers of its own (``weight-group``: ``/init_weights_update_group``
and ``/update_weights_from_distributed``; ``handoff-files``: ``/update_weights_from_tensor``
with ``--handoff-dir``). Every other one comes from an installed distribution, which declares
an :class:`EngineReceiver` in the ``miles.engine_receivers`` entry-point group under the
receiver's name::

    [project.entry-points."miles.engine_receivers"]
    disk-delta = "miles_transports.disk_delta_receiver:RECEIVER"

The contract is the dataclass below:

- ``name``: the entry point's name, which a transport's ``TransportNeeds.receiver`` names;
- ``mount(app, engine, options)``: add the receiver's routes to the engine's FastAPI app
  (``app.include_router(router)``). ``engine`` is the running
  :class:`~miles.engines.embedded.engine.EmbeddedEngine`; a receiver changes weights only
  through ``engine.weights`` (:class:`~miles.engines.embedded.weights.WeightUpdater`: ``update``
  for a whole update, ``update_bucket`` for a staged multi-bucket one), so every transport
  gets the same checks, all-or-nothing commits and version bookkeeping.
  ``options`` holds the values of the receiver's own launch options (None when not given);
- ``options``: the engine launch options it needs (:class:`ReceiverOption`). Each is an
  ``engine.options`` key the embedded launcher accepts and passes on as a command-line flag
  (``delta_root`` -> ``--delta-root``), which the engine's parser then accepts;
- ``flat``: whether it takes a whole bucket as one flat byte buffer (``EngineCapabilities.flat_receivers``).

The engine mounts every installed receiver when it starts, and the embedded launcher claims
their names as its capabilities (``EmbeddedLauncher.capabilities``), so an environment without
the distribution neither claims nor serves them. A receiver whose entry point fails to load is
logged and left out, never fatal to the engine; a run that selects a transport needing it is
refused by ``miles.capabilities.check_needs``, with the load error.

Answers follow the other weight endpoints: ``{"success": true, "message", ...}`` and, for a
refusal, ``{"success": false, "message"}`` with HTTP 400 (:func:`ok`, :func:`fail`,
:func:`run_update`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from miles.engines.embedded.engine import EmbeddedEngine

log = logging.getLogger("miles.engines.embedded")

RECEIVERS_KIND = "engine_receiver"  # the component kind (entry-point group miles.engine_receivers)
BUILTIN_RECEIVERS = frozenset({"weight-group", "handoff-files"})  # routes of server.py itself
FLAT_BUILTIN_RECEIVERS = frozenset({"weight-group"})


@dataclass(frozen=True)
class ReceiverOption:
    """One engine launch option of a receiver: ``engine.options[name]`` -> ``--name-with-dashes VALUE``."""

    name: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


MountFn = Callable[["FastAPI", "EmbeddedEngine", Mapping[str, str | None]], None]


@dataclass(frozen=True)
class EngineReceiver:
    """What a transport distribution adds to the embedded engine (see the module docstring)."""

    name: str
    mount: MountFn
    options: tuple[ReceiverOption, ...] = ()
    flat: bool = False


@dataclass(frozen=True)
class InstalledReceivers:
    """The receivers found in the entry-point group, and those whose entry point failed to load."""

    loaded: Mapping[str, EngineReceiver]
    broken: Mapping[str, str]  # name -> why it could not be loaded

    @property
    def option_names(self) -> set[str]:
        return {o.name for r in self.loaded.values() for o in r.options}


def installed_receivers() -> InstalledReceivers:
    """Load every receiver declared in ``miles.engine_receivers`` (through ``miles.plugins``)."""
    from miles._plugins.discovery import group_for, names
    from miles.errors import MilesError
    from miles.plugins import load_component

    loaded: dict[str, EngineReceiver] = {}
    broken: dict[str, str] = {}
    for name in names(group_for(RECEIVERS_KIND)):
        try:
            receiver = load_component(RECEIVERS_KIND, name)
        except MilesError as exc:  # an import failure or two distributions claiming the name
            broken[name] = str(exc)
            continue
        if not isinstance(receiver, EngineReceiver) or receiver.name != name:
            broken[name] = (
                f"engine receiver entry point {name!r} must name an EngineReceiver called {name!r} "
                f"(miles.engines.embedded.receivers), got {receiver!r}"
            )
            continue
        loaded[name] = receiver
    return InstalledReceivers(loaded, broken)


# ------------------------------------------------------- answers for routes


def ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def fail(message: str, code: int = 400) -> JSONResponse:
    from fastapi.responses import JSONResponse

    return JSONResponse({"success": False, "message": message}, status_code=code)


async def run_update(what: str, work: Callable[[], dict[str, Any]]) -> Any:
    """Run blocking ``work`` off the event loop: a refusal (``WeightUpdateError``) is a 400, anything else a 500."""
    from miles.engines.embedded.weights import WeightUpdateError

    try:
        return await asyncio.to_thread(work)
    except WeightUpdateError as exc:
        return fail(f"{what}: {exc}")
    except Exception as exc:
        log.exception("%s failed", what)
        return fail(f"{what}: {type(exc).__name__}: {exc}", code=500)
