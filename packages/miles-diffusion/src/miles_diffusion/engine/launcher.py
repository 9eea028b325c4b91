"""The ``diffusion`` engine kind: starts ``python -m miles_diffusion.engine`` processes for the core.

It is the core's process launcher (ports checked first, one log per engine under the run's
``engines/``, ``/health`` waits, attaching by ``url``, restarts by the fleet, shutdown) with this
package's command line and client. It declares the one weight receiver its engines have, the
colocated transport's hand-off files, and that its engines take no token ids (so the run loads no
tokenizer for them).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from miles.capabilities import ComponentOptions, EngineCapabilities
from miles.engines.launchers import ProcessLauncher
from miles.errors import EngineError
from miles.interfaces import EngineSpec
from miles_diffusion.engine.client import DiffusionClient

# The colocated transport's receiver (miles_transports.colocated: TransportNeeds.receiver).
HANDOFF_RECEIVER = "handoff-files"


class DiffusionEngineOptions(ComponentOptions):
    """``engine.options`` of the diffusion kind (the driver adds device, dtype, max_batch_size,
    startup_timeout_s and the run's seed to every engine itself)."""

    device: str | None = Field(None, description="cpu, cuda or cuda:N (default: engine.device)")
    dtype: str | None = Field(
        None,
        description="float32, bfloat16 or float16: the forward's compute dtype (default: engine.dtype, "
        "else model.dtype); miles run's pre-flight keeps the core path at float32",
    )
    max_batch_size: int | None = Field(None, description="most trajectories one request may ask for")
    startup_timeout_s: float | None = Field(None, description="seconds to wait for /health")
    url: str | None = Field(None, description="attach to the engine already running there")
    env: dict[str, str] | None = Field(None, description="extra environment variables of the engine process")
    handoff_dir: str | None = Field(None, description="hand-off directory (set by the colocated transport)")
    torch_threads: int | None = Field(None, description="torch threads of the engine process")
    seed: int | None = Field(
        None, description="seeds the engine's global RNG (requests bring their own seeds)"
    )
    weight_version: int | None = Field(None, description="the weight version it starts at")
    deterministic: bool | None = Field(None, description="torch's deterministic algorithms on in the engine")
    log_level: str | None = Field(None, description="debug, info, warning or error")


class DiffusionLauncher(ProcessLauncher):
    """Runs one ``python -m miles_diffusion.engine`` process per spec (or attaches by ``url``)."""

    name = "diffusion"
    capabilities = EngineCapabilities(receivers=frozenset({HANDOFF_RECEIVER}), tokens=False)
    Options = DiffusionEngineOptions  # engine.options
    launch_only_options = frozenset({"seed", "env", "weight_version", "deterministic", "log_level"})
    launch_flags_hint = "start it with the matching `python -m miles_diffusion.engine` flags"

    def client(self, url: str) -> DiffusionClient:
        return DiffusionClient(url)

    def _allowed_options(self) -> set[str]:
        return set(DiffusionEngineOptions.model_fields)

    def command(self, spec: EngineSpec, port: int) -> list[str]:
        o = spec.options
        flags = {
            "device": "--device",
            "dtype": "--dtype",
            "max_batch_size": "--max-batch-size",
            "handoff_dir": "--handoff-dir",
            "torch_threads": "--torch-threads",
            "seed": "--seed",
            "weight_version": "--weight-version",
            "log_level": "--log-level",
        }
        argv = self.module_command("miles_diffusion.engine", spec, port, flags)
        if o.get("deterministic"):
            argv.append("--deterministic")
        return argv

    def _start(self, specs: list[EngineSpec], log_dir: str, timeout: float) -> list[str]:
        for i, spec in enumerate(specs):
            if not Path(spec.model_path).is_dir():
                raise EngineError(f"diffusion engine {i}: model path {spec.model_path!r} is not a directory")
            dtype = spec.options.get("dtype")
            if dtype not in (None, "float32", "bfloat16", "float16"):
                raise EngineError(
                    f"diffusion engine {i}: dtype {dtype!r}; allowed: float32, bfloat16, float16"
                )
        return self.start_processes(specs, log_dir, timeout, log_name="diffusion-engine")
