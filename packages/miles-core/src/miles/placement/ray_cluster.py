"""The Ray cluster a run uses: attach to one or start a private one, and reserve resources in it.

Ray is an extra (``pip install 'miles-core[ray]'``) and is imported only inside these
functions, so ``miles --help`` never pays for it.

Two of Ray's documented environment switches get a different default (set before Ray is
imported, and only where the user has not set them):

- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for a private cluster or an explicit loopback
  address: Ray otherwise replaces ``127.0.0.1`` with the machine's network address so other
  nodes can reach it, but such a cluster lives on this machine only, so everything (GCS,
  raylet, engines) stays on 127.0.0.1. To attach with ``'auto'`` to a cluster started with
  ``--node-ip-address=127.0.0.1``, set it yourself (or give the address explicitly).
- ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``: under ``uv run`` Ray would ship the current directory
  to every worker and run them through ``uv run`` (which may create and sync a fresh
  environment there). Miles' actors need the installed ``miles`` packages, not a copy of
  the run directory.

A private cluster is protected by Ray's token authentication with a fresh token that lives
in this process's environment only (inherited by the cluster's processes), unless
``RAY_AUTH_MODE`` is set; attaching uses whatever the environment says, as Ray does.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.errors import ConfigError, MilesError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'miles-core[ray]'"
_PROBE_TIMEOUT_S = 5.0
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps loopback addresses
_UV_HOOK_ENV = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
_AUTH_MODE_ENV = "RAY_AUTH_MODE"
_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"


class PlacementError(MilesError):
    """The Ray cluster cannot be reached, or cannot hold the resources a placement asks for."""


@dataclass(frozen=True)
class RayCluster:
    """What a run needs to know about the cluster it is attached to."""

    address: str  # the GCS address, HOST:PORT
    node_ip: str  # this (driver) node's address as Ray sees it
    started: bool  # True when the session started the cluster (and stops it on exit)


def import_ray() -> Any:
    """``import ray``, or one clear error saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"placement.launcher is 'ray' but Ray is not installed ({exc}); {INSTALL_HINT}"
        ) from exc
    return ray


def default_bundle(device: str) -> dict[str, float]:
    """The Ray resources of one trainer rank or one engine when the recipe names none."""
    return {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}


@contextlib.contextmanager
def ray_session(
    address: str | None, *, num_cpus: int | None = None, num_gpus: int | None = None
) -> Iterator[RayCluster]:
    """Connect this process to Ray for the duration of the block.

    ``address`` is ``'auto'`` (the cluster ``ray start`` left on this machine, or
    ``$RAY_ADDRESS``) or ``'HOST:PORT'`` of a running cluster's GCS: attach to it, and only
    disconnect on exit. ``None`` starts a private single-machine cluster on 127.0.0.1 (no
    dashboard; ``num_cpus`` / ``num_gpus`` default to what the machine has) and stops it on
    exit. If Ray is already initialised in this process, that connection is used and left
    alone.
    """
    single_machine = address is None or (address != "auto" and _is_loopback(address))
    _env_defaults(single_machine)
    ray = import_ray()
    if ray.is_initialized():
        yield _describe(ray, started=False)
        return
    restore = contextlib.ExitStack()
    try:
        if address is None:
            if _AUTH_MODE_ENV not in os.environ:
                restore.callback(_set_env({_AUTH_MODE_ENV: "token", _AUTH_TOKEN_ENV: secrets.token_hex(32)}))
            ray.init(
                address="local",
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                logging_level=logging.WARNING,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
            )
            started = True
        else:
            if num_cpus is not None or num_gpus is not None:
                raise ConfigError(
                    "ray_session: num_cpus / num_gpus size a private cluster; an attached one has its own"
                )
            target = _resolve(ray, address)
            if _is_loopback(target) and _rewrites_loopback():
                raise ConfigError(
                    f"the Ray cluster at {target} is bound to a loopback address; set "
                    f"{_SINGLE_MACHINE_ENV}=0 before Ray is imported (or give placement.ray_address "
                    "as 127.0.0.1:PORT) so that Ray keeps this node on 127.0.0.1"
                )
            _probe(address, target)
            try:
                ray.init(address=target, logging_level=logging.WARNING)
            except ConnectionError as exc:
                raise PlacementError(
                    f"cannot attach to the Ray cluster at {address!r} ({target}): {exc}"
                ) from exc
            started = False
        try:
            cluster = _describe(ray, started=started)
            log.info(
                "ray: %s cluster at %s (this node %s)",
                "started a private" if started else "attached to the",
                cluster.address,
                cluster.node_ip,
            )
            yield cluster
        finally:
            # For an attached cluster this only disconnects the driver; a private one stops.
            ray.shutdown()
    finally:
        restore.close()


def placement_group_for(
    bundles: Sequence[Mapping[str, float]],
    name: str,
    strategy: str = "PACK",
    *,
    timeout_s: float = 60.0,
) -> Any:
    """Reserve ``bundles`` (one per rank or engine) and wait until the cluster has placed them.

    Fails at once, naming what is missing, when the cluster's total resources (or its
    largest node, for a single bundle or STRICT_PACK) cannot hold the request; fails after
    ``timeout_s`` when they exist but are taken. Returns the ``PlacementGroup``; remove it
    with :func:`remove_placement_group`.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [_check_bundle(b, name) for b in bundles]
    if not bundles:
        raise ConfigError(f"placement group {name!r}: no bundles")
    _check_fits(ray, bundles, name, strategy)
    group = placement_group(bundles, strategy=strategy, name=name)
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        raise PlacementError(
            f"placement group {name!r} ({len(bundles)} x {_fmt(bundles[0]) if _uniform(bundles) else bundles}, "
            f"{strategy}) was not placed within {timeout_s:g} s: the cluster has the resources but they are "
            f"in use (available now: {_fmt(ray.available_resources())})"
        )
    return group


def remove_placement_group(group: Any) -> None:
    """Give a placement group's resources back (a no-op once Ray is shut down)."""
    ray = import_ray()
    if group is None or not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group as remove

    with contextlib.suppress(Exception):  # already removed, or its job is gone
        remove(group)


def bundle_actor_options(group: Any, index: int, bundle: Mapping[str, float]) -> dict[str, Any]:
    """``.options(...)`` for an actor that takes the whole of bundle ``index`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = {k: float(v) for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {
        "num_cpus": float(bundle.get("CPU", 0.0)),
        "num_gpus": float(bundle.get("GPU", 0.0)),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        ),
    }
    if "memory" in bundle:
        options["memory"] = float(bundle["memory"])
    if resources:
        options["resources"] = resources
    return options


# ----------------------------------------------------------------- helpers


def _describe(ray: Any, *, started: bool) -> RayCluster:
    context = ray.get_runtime_context()
    return RayCluster(
        address=str(context.gcs_address), node_ip=ray.util.get_node_ip_address(), started=started
    )


def _rewrites_loopback() -> bool:
    """Does the imported Ray replace 127.0.0.1 with the network address? (read when Ray was imported)"""
    constants = sys.modules.get("ray._private.ray_constants")
    return bool(getattr(constants, "ENABLE_RAY_CLUSTER", False))


def _env_defaults(single_machine: bool) -> None:
    """Ray reads these when it is imported (see the module docstring); the user's own settings win."""
    os.environ.setdefault(_UV_HOOK_ENV, "0")
    if single_machine:
        os.environ.setdefault(_SINGLE_MACHINE_ENV, "0")


def _set_env(values: dict[str, str]) -> Any:
    """Set environment variables; returns the undo."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)

    def undo() -> None:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    return undo


def _resolve(ray: Any, address: str) -> str:
    """'auto' -> the address ``ray start`` recorded (or $RAY_ADDRESS); HOST:PORT as given."""
    if address.startswith("ray://"):
        raise ConfigError(
            f"placement.ray_address {address!r}: Ray Client addresses are not supported; give the GCS "
            "address HOST:PORT (what `ray start --head` prints), or 'auto' on a cluster node"
        )
    if address != "auto":
        return address
    from ray._private.services import get_ray_address_from_environment

    try:
        found = get_ray_address_from_environment("auto", None)
    except Exception as exc:  # Ray raises ConnectionError (or others, by version) when none is found
        found = None
        detail = f" ({exc})"
    else:
        detail = ""
    if not found or found == "auto":
        raise PlacementError(
            f"placement.ray_address is 'auto' but no running Ray cluster was found on this machine{detail}; "
            "start one with `ray start --head` or give its address HOST:PORT"
        )
    return str(found)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"placement.ray_address {address!r} is not HOST:PORT or 'auto'")
    return host.strip("[]"), int(port)


def _is_loopback(address: str) -> bool:
    host, _ = _split(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _probe(given: str, address: str) -> None:
    """A TCP connect first: ``ray.init`` retries an unreachable address for minutes."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise PlacementError(
            f"cannot reach the Ray cluster at {given!r} ({address}): {exc.strerror or exc}; start one with "
            "`ray start --head` (see docs/placement.md) or fix placement.ray_address"
        ) from None


def _check_bundle(bundle: Mapping[str, float], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in bundle.items():
        if not isinstance(value, int | float) or value < 0:
            raise ConfigError(
                f"placement group {name!r}: resource {key!r} must be a number >= 0, got {value!r}"
            )
        if value > 0:
            out[str(key)] = float(value)
    if not out:
        raise ConfigError(
            f"placement group {name!r}: a bundle must ask for some resource, got {dict(bundle)}"
        )
    return out


def _check_fits(ray: Any, bundles: Sequence[Mapping[str, float]], name: str, strategy: str) -> None:
    total = ray.cluster_resources()
    wanted: dict[str, float] = {}
    for b in bundles:
        for key, value in b.items():
            wanted[key] = wanted.get(key, 0.0) + value
    missing = {k: v - total.get(k, 0.0) for k, v in wanted.items() if v > total.get(k, 0.0) + 1e-9}
    what = f"{len(bundles)} x {_fmt(bundles[0])}" if _uniform(bundles) else str(bundles)
    if missing:
        raise PlacementError(
            f"placement group {name!r} needs {_fmt(wanted)} ({what}) but the whole cluster has "
            f"{_fmt({k: total.get(k, 0.0) for k in wanted})}; missing {_fmt(missing)}. Add nodes, or ask for "
            "less (placement.trainer_bundle / placement.engine_bundle, fsdp.num_ranks, engine.num_engines)"
        )
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    largest = [b for b in bundles if not any(all(n.get(k, 0.0) >= v for k, v in b.items()) for n in nodes)]
    if largest:
        raise PlacementError(
            f"placement group {name!r}: no single node can hold the bundle {_fmt(largest[0])} (nodes have "
            f"{[_fmt({k: n.get(k, 0.0) for k in largest[0]}) for n in nodes]})"
        )
    if strategy == "STRICT_PACK" and not any(
        all(n.get(k, 0.0) >= v for k, v in wanted.items()) for n in nodes
    ):
        raise PlacementError(f"placement group {name!r}: STRICT_PACK needs one node with {_fmt(wanted)}")


def _uniform(bundles: Sequence[Mapping[str, float]]) -> bool:
    return all(b == bundles[0] for b in bundles)


def _fmt(resources: Mapping[str, float]) -> str:
    shown = {k: (int(v) if float(v).is_integer() else round(v, 3)) for k, v in sorted(resources.items())}
    return "{" + ", ".join(f"{k}: {v}" for k, v in shown.items()) + "}"
