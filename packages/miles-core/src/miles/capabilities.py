"""What components need from a run and what engines provide: typed metadata instead of names.

The driver and the recipe checks never compare a component's name with a built-in one.
A component that needs something declares it, and a third-party component declares it the
same way:

- a **transport** class sets ``needs = TransportNeeds(...)`` (the placement it runs under,
  whether it needs engines this run launched, which engine-side receiver it talks to) and may
  define ``prepare_engines(setup)``, which returns the options the engines must be launched
  with and the transport options that go with them (whether a restarted engine can rejoin it
  is its ``reconnect``: see miles.driver.fleet);
- an **engine kind** (its launcher class) sets ``capabilities = EngineCapabilities(...)``
  (the weight receivers it has) and builds its client with ``client(url)``, which every path
  that talks to engines uses (``engine_client_factory``);
- a **generate function** carries ``GenerateNeeds`` (``@declare_needs(GenerateNeeds(...))``); the
  core declares no field of its own there: a plugin subclasses it with what its rollout services
  and checks read (``miles_rollout_services``, ``miles_check_config``), so the core never learns
  what a plugin's generate functions need;
- a **filter** carries ``FilterNeeds`` (the smallest group it can judge);
- a component that takes options declares them as a pydantic model: ``Options = MyOptions``
  on a class, or ``@declare_options(MyOptions)`` next to ``declare_needs`` (usually a subclass
  of :class:`ComponentOptions`, which refuses unknown keys). The recipe's options mapping of the
  component is validated against it before anything starts, with the file and line of each bad
  key (``miles.config.options``); ``miles plugins --details`` and ``miles config schema`` list its
  fields. A component without a model takes its options as a free-form mapping, as before.

- a **data source** for ``mode: sft`` whose items are not chat conversations implements
  ``miles.interfaces.SupervisedSampleSource`` (its ``sample_kind``), and a **backend** lists the
  kinds it trains there in ``supervised_kinds`` (``check_supervised_kinds``).

``check_needs(config)`` refuses, in one line per problem, a recipe whose components do not
fit together; the run calls it before it writes or starts anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from miles.errors import ConfigError

if TYPE_CHECKING:
    from miles.config.schema import MilesConfig
    from miles.interfaces import EngineClient

PlacementMode = Literal["colocated", "disaggregated"]
# The placement mode in which trainer and engines share the devices (the trainer is offloaded while
# the engines generate). A placement mode, not a component: the transport of that name declares it.
SHARED_DEVICES: PlacementMode = "colocated"
T = TypeVar("T")


@dataclass(frozen=True)
class TransportNeeds:
    """What a weight transport needs from the run."""

    # The placement it runs under (None: either; a run without placement.mode takes the transport's,
    # and disaggregated when it names none).
    placement: PlacementMode | None = None
    launched_engines: bool = False  # engines this run starts on this machine (not engine.urls)
    receiver: str | None = None  # the engine-side receiver it talks to; the engine kind must have it
    # The device type trainer and engines must run on (None: any), e.g. "cuda" for CUDA IPC handles.
    device_type: str | None = None


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine kind can do."""

    receivers: frozenset[str] = frozenset()  # weight receivers it has (see TransportNeeds.receiver)
    # Receivers that take a whole bucket as one flat byte buffer (fewer, larger messages).
    flat_receivers: frozenset[str] = frozenset()
    # (receiver, why) for receivers it would have but could not load (a broken plugin): a run
    # that needs one is refused with the reason.
    unavailable: tuple[tuple[str, str], ...] = ()
    # Whether its engines return MoE routing when a request asks (``return_routed_experts``): None if
    # they cannot; else the engine options, as (key, value) pairs, that engines this run launches
    # need for it (empty: none). A run that records routing is refused on a kind that cannot.
    routing_capture: tuple[tuple[str, Any], ...] | None = None
    # Whether its engines take token ids: the driver then loads the policy's tokenizer for the
    # rollout and evaluation. An engine kind that generates something else (images from prompt
    # ids) sets False, and its rollout gets ``RolloutContext.tokenizer = None``.
    tokens: bool = True


@dataclass
class EngineSetup:
    """What a transport may look at when it prepares the engines (``prepare_engines``)."""

    engine: EngineCapabilities
    engine_dtype: str
    work_dir: str  # the run directory
    options: dict[str, Any]  # weight_sync.options as the recipe gives them
    stack: contextlib.ExitStack  # for what must be cleaned up when the engines stop


@dataclass
class EnginePrep:
    """What a transport asks for: options the engines are launched with, and its own options."""

    engine_options: dict[str, Any] = field(default_factory=dict)
    transport_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateNeeds:
    """What a generate function needs from the run: the base a plugin subclasses with its own fields.

    The plugin that owns a subclass reads it (``generate_needs(config)``) in its
    ``miles_check_config`` and ``miles_rollout_services`` hooks; a generate function that declares
    nothing needs nothing.
    """


@dataclass(frozen=True)
class FilterNeeds:
    """What a group filter needs from the run."""

    min_group_size: int = 1


class ComponentOptions(BaseModel):
    """Base of a component's options model: one field per option (type, default, description).

    Unknown keys are refused, and values are taken strictly as the YAML gives them (no string
    read as a number, no true as 1; an integer is a float). Where the options are the
    component's keyword arguments (a class built with them), the made component gets every
    field's value, validated.
    """

    model_config = ConfigDict(extra="forbid", strict=True)


class NoOptions(ComponentOptions):
    """The model of a component that takes no options: every key is refused."""


# The kinds whose recipe options are handed to the component as one mapping rather than as its
# keyword arguments: a rollout or generate function reads ``rollout.options`` (RolloutContext.options),
# a data source gets ``data.options`` as its ``options`` argument, an engine kind ``engine.options``
# in each EngineSpec. Their model describes that mapping, and so does a tracker's (built as
# ``cls(ctx, options)``, miles.tracking.base); every other kind's model describes the keyword
# arguments it is built with. A plugin's kind says which with ``ComponentKind.options``.
CORE_MAPPING_OPTION_KINDS = frozenset({"rollout", "generate", "data_source", "engine", "tracker"})


def takes_options_as_mapping(kind: str) -> bool:
    """Whether ``kind``'s recipe options reach its components as one mapping (not keyword arguments)."""
    if kind in CORE_MAPPING_OPTION_KINDS:
        return True
    from miles._plugins.discovery import declared_kind

    declared = declared_kind(kind)
    return declared is not None and declared.options == "mapping"


def declare_options(model: type[BaseModel]) -> Callable[[T], T]:
    """Attach an options model to a component (``@declare_options(MyOptions)``; a class may set ``Options``)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"declare_options takes a pydantic model class, got {model!r}")

    def mark(component: T) -> T:
        component.Options = model  # type: ignore[attr-defined]
        return component

    return mark


def options_model(component: object, what: str) -> type[BaseModel] | None:
    """The options model ``component`` declares (its ``Options``), or None: free-form options."""
    model = getattr(component, "Options", None)
    if model is None:
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ConfigError(f"{what} declares Options={model!r}; expected a pydantic model class")
    return model


NO_TRANSPORT_NEEDS = TransportNeeds()
NO_ENGINE_CAPABILITIES = EngineCapabilities()
NO_GENERATE_NEEDS = GenerateNeeds()
NO_FILTER_NEEDS = FilterNeeds()


def declare_records_routing(fn: T) -> T:
    """Mark a generate (or whole-rollout) function that records MoE routing when the run asks for it:
    with ``ctx.return_routed_experts`` it asks the engines for routing and fills every sample's
    ``prompt_routed_experts`` and ``routed_experts`` (miles.routing). A run that records routing is
    refused with a function that does not say so."""
    fn.records_routing = True  # type: ignore[attr-defined]
    return fn


def declares_records_routing(component: object) -> bool:
    """Whether a rollout or generate function declares that it records MoE routing."""
    return getattr(component, "records_routing", False) is True


def declare_needs(needs: object) -> Callable[[T], T]:
    """Attach ``needs`` to a function component (``@declare_needs(MyGenerateNeeds(...))``)."""

    def mark(fn: T) -> T:
        fn.needs = needs  # type: ignore[attr-defined]
        return fn

    return mark


def _declared(component: object, expected: type[T], default: T, what: str) -> T:
    needs = getattr(component, "needs", default)
    if not isinstance(needs, expected):
        raise ConfigError(f"{what} declares needs={needs!r}; expected a {expected.__name__}")
    return needs


def transport_needs(config: MilesConfig) -> TransportNeeds:
    from miles.plugins import load_component

    cls = load_component("transport", config.transport)
    return _declared(cls, TransportNeeds, NO_TRANSPORT_NEEDS, f"transport {config.transport!r}")


def engine_capabilities(launcher: object) -> EngineCapabilities:
    caps = getattr(launcher, "capabilities", NO_ENGINE_CAPABILITIES)
    if not isinstance(caps, EngineCapabilities):
        raise ConfigError(
            f"engine launcher {launcher!r} declares capabilities={caps!r}; expected EngineCapabilities"
        )
    return caps


def engine_client_factory(config: MilesConfig) -> Callable[[str], EngineClient]:
    """How the recipe's engine kind talks to one of its engines: its launcher's ``client(url)``.

    Everything that talks to engines (rollout, evaluation, served teachers, the session server)
    builds its clients with this, so an engine kind that brings its own client is used everywhere.
    """
    from miles.plugins import make_component

    return make_component("engine", config.engine.launcher).client


def generate_needs(config: MilesConfig) -> GenerateNeeds:
    from miles.plugins import load_component

    fn = load_component("generate", config.rollout.generate_fn)
    return _declared(
        fn, GenerateNeeds, NO_GENERATE_NEEDS, f"rollout.generate_fn {config.rollout.generate_fn!r}"
    )


def resolved_placement(config: MilesConfig) -> PlacementMode:
    """``placement.mode``, or the transport's own placement when the recipe leaves it unset."""
    if config.placement.mode is not None:
        return config.placement.mode
    return transport_needs(config).placement or "disaggregated"


def shares_devices(config: MilesConfig) -> bool:
    """Whether the run's trainer and engines share devices (placement.mode, or the transport's own)."""
    return resolved_placement(config) == SHARED_DEVICES


def check_needs(config: MilesConfig) -> None:
    """Refuse a recipe whose components do not fit together (loads the components it asks about)."""
    if config.mode != "rl":
        return
    _check_transport(config)
    _check_release_memory(config)
    _check_filters(config)
    _check_plugins(config)


def _check_transport(config: MilesConfig) -> None:
    from miles.plugins import load_component

    needs = transport_needs(config)
    name = repr(config.transport)
    placement = resolved_placement(config)
    if needs.placement is not None and placement != needs.placement:
        raise ConfigError(
            f"transport {name} runs under placement.mode {needs.placement!r}, but the recipe sets "
            f"{placement!r}; choose another transport or placement.mode: {needs.placement}"
        )
    if config.schedule == "fully_async" and placement == SHARED_DEVICES:
        raise ConfigError(
            "schedule 'fully_async' needs a disaggregated placement (engines generate while the trainer "
            f"trains, so they cannot share its devices); transport {name} with placement.mode 'colocated' "
            "cannot run it: use a transport for disaggregated engines, or schedule: sync"
        )
    if needs.launched_engines and config.engine.urls:
        raise ConfigError(
            f"transport {name} needs engines launched by this run on this machine, not engine.urls"
        )
    if needs.device_type is not None:
        _check_device_type(config, name, needs.device_type)
    caps = engine_capabilities(load_component("engine", config.engine.launcher))
    if needs.receiver is not None and needs.receiver not in caps.receivers:
        broken = dict(caps.unavailable).get(needs.receiver)
        if broken is not None:
            raise ConfigError(
                f"transport {name} talks to an engine-side {needs.receiver!r} receiver, which engine.launcher "
                f"{config.engine.launcher!r} could not load: {broken}"
            )
        raise ConfigError(
            f"transport {name} talks to an engine-side {needs.receiver!r} receiver, which engine.launcher "
            f"{config.engine.launcher!r} does not have (it has: {', '.join(sorted(caps.receivers)) or 'none'}); "
            "choose a transport that engine kind supports"
        )


def _check_device_type(config: MilesConfig, transport: str, device_type: str) -> None:
    """The engines (engine.device) and the trainer (the backend section's ``device``, if it has one)."""
    section = getattr(config, config.backend, None)
    devices = {"engine.device": config.engine.device}
    trainer_device = getattr(section, "device", None)
    if isinstance(trainer_device, str):
        devices[f"{config.backend}.device"] = trainer_device
    wrong = {k: v for k, v in devices.items() if v.split(":")[0] != device_type}
    if wrong:
        got = ", ".join(f"{k} is {v!r}" for k, v in wrong.items())
        raise ConfigError(
            f"transport {transport} needs the trainer and the engines on {device_type} devices, but {got}; "
            f"set them to {device_type} (one shared device), or choose another transport"
        )


def _check_release_memory(config: MilesConfig) -> None:
    if config.engine.release_memory and resolved_placement(config) != SHARED_DEVICES:
        raise ConfigError(
            "engine.release_memory frees the engines' KV cache while the trainer trains on the devices they "
            f"share; this run's placement is {resolved_placement(config)!r}, where nothing is shared: set "
            "placement.mode: colocated (or a colocated transport), or engine.release_memory: false"
        )


def _check_plugins(config: MilesConfig) -> None:
    """What plugins refuse about the recipe (``miles_check_config``), after the core's own checks."""
    from miles.plugins import get_plugin_manager

    generate_needs(config)  # a generate function that declares malformed needs fails here, by name
    get_plugin_manager().hook.miles_check_config(config=config)


def _check_filters(config: MilesConfig) -> None:
    from miles.plugins import load_component

    n = config.rollout.n_samples_per_prompt
    for name in config.rollout.filters:
        needs = _declared(load_component("filter", name), FilterNeeds, NO_FILTER_NEEDS, f"filter {name!r}")
        if n < needs.min_group_size:
            raise ConfigError(
                f"rollout.filters contains {name!r}, which needs groups of at least {needs.min_group_size} "
                f"samples, but rollout.n_samples_per_prompt is {n}: every group would be dropped; raise "
                "n_samples_per_prompt or remove the filter"
            )


def supervised_kind(data_source: object) -> str:
    """The sample kind a data source yields for ``mode: sft`` (chat conversations: ``tokens``)."""
    from miles.interfaces import TOKEN_SAMPLES, SupervisedSampleSource

    inner = getattr(data_source, "inner", data_source)  # the driver's thread-safe wrapper
    if isinstance(inner, SupervisedSampleSource):
        return str(inner.sample_kind)
    return TOKEN_SAMPLES


def backend_supervised_kinds(backend: object) -> frozenset[str]:
    """The sample kinds a backend (class or instance) trains in ``mode: sft``."""
    from miles.interfaces import TOKEN_SAMPLES

    kinds = getattr(backend, "supervised_kinds", frozenset({TOKEN_SAMPLES}))
    if not isinstance(kinds, frozenset) or not all(isinstance(k, str) for k in kinds):
        raise ConfigError(
            f"backend {backend!r} declares supervised_kinds={kinds!r}; expected a frozenset of str"
        )
    return kinds


def check_supervised_kinds(config: MilesConfig, data_source: object) -> None:
    """``mode: sft``: the data source's sample kind is one the backend trains (one line if not)."""
    from miles.plugins import load_component

    kind = supervised_kind(data_source)
    kinds = backend_supervised_kinds(load_component("backend", config.backend))
    if kind not in kinds:
        raise ConfigError(
            f"data.source {config.data.source!r} yields {kind!r} samples for mode: sft, but backend "
            f"{config.backend!r} trains {', '.join(repr(k) for k in sorted(kinds))} samples only; pair the "
            "data source with a backend that trains its kind"
        )
