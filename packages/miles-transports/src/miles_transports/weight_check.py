"""The opt-in weight-equality check: after the first update, every engine tensor must equal the trainer's.

Before the first update each engine fills its tensors with random values
(``/weights_checker reset_tensors``), so a tensor the update misses cannot pass by
still holding the checkpoint's value. A delta update is computed against the engine's
current bytes, so it cannot start from random ones; there the engine itself verifies
the digest of every resulting tensor, and the comparison after the update still runs. While the update streams, the check records a
digest of every tensor the trainer sends; afterwards it asks each engine for the
digests of what it holds (``/weights_checker checksum``) and compares.

Comparison: bit-exact by default. With ``mode: rounded`` a trainer tensor is first cast
to the dtype the engine reports for it, so the only difference allowed is the rounding
of the engine's own format (an fp32 trainer feeding a bf16 engine). Engine-only tensors
(that the trainer never sends, e.g. a rotary cache) are skipped; ``skip`` names more.
A mismatch raises ``WeightCheckError`` naming the engine and the first tensors that
differ, so a run never trains on after a silently wrong update.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal

from miles.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from miles_transports.fanout import EngineFanout

Mode = Literal["exact", "rounded"]
_SHOWN = 5


class WeightCheckError(EngineError):
    """An engine's weights differ from the trainer's after an update."""


class WeightEqualityCheck:
    def __init__(self, mode: Mode = "exact", skip: Sequence[str] = ()) -> None:
        if mode not in ("exact", "rounded"):
            raise ConfigError(f"weight check: mode must be exact or rounded, got {mode!r}")
        self.mode = mode
        self.skip = frozenset(skip)
        self.engine_dtypes: list[dict[str, str]] = []
        self.sent: dict[str, dict[str, str]] = {}  # name -> {engine dtype: digest}
        # A LoRA update: only this adapter's tensors are randomised and compared (the base is not sent).
        self.adapter: str | None = None

    def _scope(self) -> dict[str, str]:
        return {} if self.adapter is None else {"lora_name": self.adapter}

    def prepare(self, engines: EngineFanout, *, randomize: bool = True) -> None:
        """Randomise the engines' tensors (unless the update needs them as its base) and learn their dtypes."""
        if randomize:
            engines.call_all("weights_checker", "reset_tensors", skip=sorted(self.skip), **self._scope())
        answers = engines.call_all("weights_checker", "checksum", skip=sorted(self.skip), **self._scope())
        self.engine_dtypes = [{name: info["dtype"] for name, info in answer.items()} for answer in answers]

    def observe(
        self, named_tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, recording the digest of each tensor as each engine should hold it."""
        from miles.engines.digest import tensor_digest

        for name, tensor in named_tensors:
            if name not in self.skip:
                wanted = {dtypes[name] for dtypes in self.engine_dtypes if name in dtypes}
                digests = {}
                for dtype in wanted:
                    digests[dtype] = tensor_digest(self._as_engine_holds(tensor, dtype, name))
                self.sent[name] = digests
            yield name, tensor

    def verify(self, engines: EngineFanout) -> int:
        """Compare every engine's tensors with what was sent; returns the number of tensors compared."""
        answers = engines.call_all("weights_checker", "checksum", skip=sorted(self.skip), **self._scope())
        compared = 0
        for url, answer in zip(engines.urls, answers, strict=True):
            wrong: list[str] = []
            missing = sorted(name for name in self.sent if name not in answer)
            for name, info in answer.items():
                if name in self.skip or name not in self.sent:
                    continue  # engine-only tensor
                compared += 1
                expected = self.sent[name].get(info["dtype"])
                if expected != info["digest"]:
                    wrong.append(name)
            if missing:
                raise WeightCheckError(
                    f"weight check: engine {url} has no tensor named {missing[:_SHOWN]} that the trainer sent "
                    f"({len(missing)} in all); the names must match the engine's state dict"
                )
            if wrong:
                raise WeightCheckError(
                    f"weight check: after the update, {len(wrong)} tensor(s) on engine {url} differ from the "
                    f"trainer's ({self.mode}): {wrong[:_SHOWN]}{' ...' if len(wrong) > _SHOWN else ''}"
                )
        return compared

    def _as_engine_holds(self, tensor: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
        import torch

        engine_dtype = getattr(torch, dtype.removeprefix("torch."))
        if tensor.dtype == engine_dtype:
            return tensor
        if self.mode == "exact":
            raise WeightCheckError(
                f"weight check: tensor {name!r} is sent as {tensor.dtype} but an engine holds it as {dtype}; "
                "bit-exact comparison needs the same dtype (set weight_sync.check_mode: rounded to compare "
                "within the engine format's rounding, or send in the engine's dtype)"
            )
        return tensor.to(engine_dtype)
