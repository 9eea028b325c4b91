"""``backend: megatron`` as the driver selects it (entry point ``miles.backends:megatron``).

What exists today is the part that runs before a rank starts: the no-CUDA refusal
(``hooks.runtime_problem``), the layout plan (``layout``), the model config and the HF
weight conversion (``model_config``, ``convert``). The training step, checkpoints, weight
export to the transports, R3, offload and streaming are not built yet (issue 17), so
``setup`` refuses in one line after its checks instead of pretending to train.
"""

from __future__ import annotations

from typing import Any

from miles.errors import ConfigError
from miles.interfaces import BackendSpec, TransportStats
from miles.types import Sample, TrainBatch
from miles_megatron.config import MegatronOptions
from miles_megatron.hf_config import HFModel
from miles_megatron.hooks import runtime_problem
from miles_megatron.layout import ModelShape, ParallelLayout, plan_layout

NOT_BUILT = (
    "backend 'megatron': the training step is not built yet (issue 17 has the HF conversion and layout "
    "planning so far); use backend: fsdp"
)


class MegatronBackend:
    """``miles.interfaces.Backend`` on megatron-core; options come from the ``megatron`` section."""

    def __init__(self) -> None:
        self.layout: ParallelLayout | None = None

    def setup(self, spec: BackendSpec) -> None:
        problem = runtime_problem()
        if problem is not None:
            raise ConfigError(problem)
        options = MegatronOptions.model_validate(spec.options.get("megatron", {}))
        layout = plan_layout(options)
        layout.check_model(ModelShape.of(HFModel.from_dir(spec.model_path)))
        self.layout = layout
        raise ConfigError(NOT_BUILT)

    def _refuse(self) -> Any:
        raise RuntimeError(NOT_BUILT)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._refuse()

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        return self._refuse()

    def update_weights(self, version: int) -> TransportStats:
        return self._refuse()

    def save_checkpoint(self, directory: str) -> None:
        self._refuse()

    def load_checkpoint(self, directory: str) -> None:
        self._refuse()

    def export_hf(self, directory: str) -> None:
        self._refuse()

    def shutdown(self) -> None:
        self.layout = None
