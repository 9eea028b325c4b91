"""Loading new weights into the running model, all-or-nothing.

Every path first gathers the complete set of new tensors and checks each one
against the model (known name, same shape, a dtype that can be cast) before a
single parameter is written; a bad tensor is refused with its name and the model
is left as it was. Tensor names are the model's ``state_dict`` names under the
installed transformers version (what an HF trainer's ``state_dict`` holds).

Sources:

- a Hugging Face directory (``/update_weights_from_disk``), read with
  transformers' own loader so checkpoint-format conversions apply;
- a broadcast over a weight group (``/update_weights_from_distributed``): tensors
  are received into staging buffers in the announced order. If the announced
  metadata does not fit the model the tensors are still received (so the sender
  is not left blocked in a collective) and then discarded;
- safetensors files in the hand-off directory (``/update_weights_from_tensor``
  with ``load_format: miles_safetensors_file``): the colocated path. Names from
  the network are resolved and must stay inside that directory; nothing is
  unpickled.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from miles.engines.weight_group import WeightGroup

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightUpdateError(ValueError):
    """A weight update was refused; the model is unchanged."""


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r} (expected e.g. 'float32', 'bfloat16', 'float16')")
    return value


class WeightUpdater:
    def __init__(self, model: torch.nn.Module, *, handoff_dir: str | None = None) -> None:
        self.model = model
        # state_dict(keep_vars) also lists tied aliases (lm_head.weight when tied to the embeddings).
        self.targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.handoff_dir = Path(handoff_dir).resolve() if handoff_dir else None
        self.groups: dict[str, WeightGroup] = {}
        self.lock = threading.Lock()  # one update at a time, in arrival order

    # --------------------------------------------------------------- checking

    def check(self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Raise WeightUpdateError for the first tensor that does not fit the model."""
        seen: set[str] = set()
        for name, shape, dtype in specs:
            if name in seen:
                raise WeightUpdateError(f"tensor {name!r} appears twice in one update")
            seen.add(name)
            target = self.targets.get(name)
            if target is None:
                example = next(iter(self.targets), "")
                raise WeightUpdateError(
                    f"tensor {name!r} is not a parameter of this model (names are the model's state_dict "
                    f"names, e.g. {example!r})"
                )
            if tuple(shape) != tuple(target.shape):
                raise WeightUpdateError(
                    f"tensor {name!r} has shape {list(shape)}, the model's is {list(target.shape)}"
                )
            if dtype != target.dtype and not (dtype.is_floating_point and target.dtype.is_floating_point):
                raise WeightUpdateError(f"tensor {name!r} has dtype {dtype}, the model's is {target.dtype}")

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors in. The caller holds the scheduler's step lock."""
        with torch.no_grad():
            for name, value in tensors.items():
                self.targets[name].copy_(value)

    # ----------------------------------------------------------------- disk

    def read_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        path = Path(model_path)
        if not path.is_dir():
            raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
        if not any(path.glob("*.safetensors")):
            raise WeightUpdateError(f"model_path {model_path!r} holds no *.safetensors files")
        from transformers import AutoModelForCausalLM

        dtype = next(iter(self.targets.values())).dtype
        try:
            fresh, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
        except Exception as exc:
            raise WeightUpdateError(f"cannot load {model_path!r}: {type(exc).__name__}: {exc}") from exc
        if type(fresh) is not type(self.model):
            raise WeightUpdateError(
                f"{model_path!r} is a {type(fresh).__name__}, the engine serves a {type(self.model).__name__}"
            )
        missing = list(info.get("missing_keys") or [])
        if missing:
            raise WeightUpdateError(
                f"{model_path!r} lacks {len(missing)} tensors the model needs, e.g. {sorted(missing)[:3]}"
            )
        state = dict(fresh.state_dict())
        self.check((n, t.shape, t.dtype) for n, t in state.items())
        return state

    # -------------------------------------------------------------- hand-off

    def resolve_handoff(self, name: str) -> Path:
        if self.handoff_dir is None:
            raise WeightUpdateError(
                "this engine was started without --handoff-dir; it takes no hand-off files"
            )
        if not name or "\x00" in name:
            raise WeightUpdateError("hand-off file name is empty")
        candidate = Path(name)
        if not candidate.is_absolute():
            candidate = self.handoff_dir / candidate
        resolved = Path(os.path.realpath(candidate))
        if not resolved.is_relative_to(self.handoff_dir):
            raise WeightUpdateError(
                f"hand-off file {name!r} is outside the hand-off directory {str(self.handoff_dir)!r}"
            )
        if not resolved.is_file():
            raise WeightUpdateError(f"hand-off file {name!r} does not exist in {str(self.handoff_dir)!r}")
        return resolved

    def read_handoff(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        paths = [self.resolve_handoff(n) for n in names]
        specs: list[tuple[str, list[int], torch.dtype]] = []
        for path in paths:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        piece = f.get_slice(key)
                        code = piece.get_dtype()
                        if code not in _SAFETENSORS_DTYPES:
                            raise WeightUpdateError(
                                f"tensor {key!r} in {path.name!r} has unsupported dtype {code}"
                            )
                        specs.append((key, list(piece.get_shape()), _SAFETENSORS_DTYPES[code]))
            except WeightUpdateError:
                raise
            except Exception as exc:
                raise WeightUpdateError(
                    f"hand-off file {path.name!r} is not a readable safetensors file: {exc}"
                ) from exc
        self.check(specs)  # metadata only: nothing has been read or written yet
        tensors: dict[str, torch.Tensor] = {}
        for path in paths:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118
                    tensors[key] = f.get_tensor(key)
        return tensors

    # ----------------------------------------------------------- distributed

    def receive(
        self, group: WeightGroup, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> dict[str, torch.Tensor]:
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one each per tensor is required"
            )
        parsed = [parse_dtype(d) for d in dtypes]  # unknown dtype: cannot even receive; refuse up front
        problem: WeightUpdateError | None = None
        try:
            self.check(zip(names, shapes, parsed, strict=True))
        except WeightUpdateError as exc:
            problem = exc
        staging: dict[str, torch.Tensor] = {}
        for name, shape, dtype in zip(names, shapes, parsed, strict=True):
            buf = torch.empty([int(s) for s in shape], dtype=dtype, device=group.device)
            group.broadcast(buf, src=0)
            staging[name] = buf
        if problem is not None:
            raise WeightUpdateError(
                f"{problem} (the broadcast was received and discarded; the model is unchanged)"
            )
        return staging

    def describe(self) -> dict[str, Any]:
        return {
            "groups": sorted(self.groups),
            "handoff_dir": str(self.handoff_dir) if self.handoff_dir else None,
        }
