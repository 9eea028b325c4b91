"""Component kinds a distribution adds to the recipe's vocabulary (the ``miles.kinds`` group).

The core defines the kinds its loop calls (backend, transport, reward, ...). A plugin whose own
code calls components of a new kind (an agentic package's agents and tool sets, say) declares
that kind instead of the core naming it: an entry point ``name = "pkg.module:KIND"`` in the
``miles.kinds`` group, whose object is a :class:`ComponentKind`. From then on
``make_component(name, ref)`` resolves that kind's components from ``kind.group``, checks them
against ``kind.protocol``, and the recipe's options for them are validated like any other kind's.

The declaring module is imported when the kind is first needed, so keep it light: a
``ComponentKind`` names its protocol by import path and imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KINDS_GROUP = "miles.kinds"

OptionsStyle = Literal["arguments", "mapping"]


@dataclass(frozen=True)
class ComponentKind:
    """What the loader needs to know about a kind of component.

    ``group``: the entry-point group its components are declared in (``miles.<plural>``).
    ``protocol``: ``"pkg.module:Protocol"`` a made component must satisfy (a runtime-checkable
    Protocol), or ``None`` for a plain callable. ``called_with``: the positional arguments a
    callable component is called with, checked against its signature when it is made.
    ``options``: how the recipe's options reach a component: as the keyword arguments of its
    class (``arguments``) or as one mapping the caller hands over whole (``mapping``).
    """

    group: str
    protocol: str | None = None
    called_with: tuple[str, ...] = ()
    options: OptionsStyle = "arguments"

    def __post_init__(self) -> None:
        if not self.group.startswith("miles.") or self.group == KINDS_GROUP:
            raise ValueError(
                f"a component kind's group must be a 'miles.*' entry-point group, got {self.group!r}"
            )
        if self.protocol is not None and ":" not in self.protocol:
            raise ValueError(
                f"ComponentKind.protocol must be 'package.module:Protocol', got {self.protocol!r}"
            )
        if self.options not in ("arguments", "mapping"):
            raise ValueError(f"ComponentKind.options must be 'arguments' or 'mapping', got {self.options!r}")
