"""Where the trainer and the engines run, and who starts them.

Local processes are the default (the backend spawns its ranks, the engine launcher its
servers). With ``placement.launcher: ray`` the run attaches to a Ray cluster
(:func:`ray_session`), the trainer's ranks become actors in one placement group (the
backend's business, e.g. ``miles_fsdp.ray_ranks``) and the engines become actors in another
(:class:`RayEngineLauncher`). Nothing here imports Ray until it is used.
"""

from __future__ import annotations

from miles.placement.ray_cluster import (
    PlacementError,
    RayCluster,
    bundle_actor_options,
    default_bundle,
    placement_group_for,
    ray_session,
    remove_placement_group,
)
from miles.placement.ray_engines import RayEngineLauncher

__all__ = [
    "PlacementError",
    "RayCluster",
    "RayEngineLauncher",
    "bundle_actor_options",
    "default_bundle",
    "placement_group_for",
    "ray_session",
    "remove_placement_group",
]
