"""Loading new weights into the running model: checked, staged, then committed all at once.

Every update is all-or-nothing. New tensors are first gathered and checked against
the model (known name, same shape, a dtype that can be cast) before a single
parameter is written; a bad tensor is refused with its name and the model is left
as it was. Tensor names are the model's ``state_dict`` names under the installed
transformers version (what an HF trainer's ``state_dict`` holds).

Sources:

- a Hugging Face directory (``/update_weights_from_disk``), read with
  transformers' own loader so checkpoint-format conversions apply;
- a broadcast over a weight group (``/update_weights_from_distributed``): tensors
  are received in the announced order. If the announced metadata does not fit the
  model the tensors are still received (so the sender is not left blocked in a
  collective) and then discarded;
- safetensors files in the hand-off directory (``/update_weights_from_tensor``
  with ``load_format: miles_safetensors_file``): the colocated path. Names from
  the network are resolved and must stay inside that directory; nothing is
  unpickled;
- whatever an installed receiver reads (:mod:`miles.engines.embedded.receivers`), e.g.
  the disk-delta receiver of miles-transports: it reads and verifies a whole update
  against :meth:`WeightUpdater.cpu_tensors` and commits it with :meth:`WeightUpdater.update`,
  or stages buckets with :meth:`WeightUpdater.update_bucket` (the p2p receiver).

Multi-bucket updates (broadcast and hand-off) are transactions. A trainer sends one
update as several calls ("buckets") and puts ``weight_version`` on the last one
only. A bucket without ``weight_version`` is checked and kept in a staging area that
generation never sees; the bucket with ``weight_version`` commits everything staged
plus itself, then sets the version. The commit is the only step that pauses
generation (it holds the scheduler's step lock, between two decode steps). So an
engine serves either the old weights or the new ones, never a mix:

- A bucket that fails its checks (or whose receive fails) discards the whole staged
  update; the error names the tensor. The sender is told, so it aborts the update.
- A staged update that receives no bucket for ``update_timeout_s`` (the sender
  died or gave up) is discarded and logged. The timeout counts from the latest
  bucket, so a long update of many buckets is fine as long as it keeps moving.
  The sender was not told, so the next bucket that carries no ``bucket_index``
  is refused once, with the reason: it may be the rest of the dropped update,
  and committing it alone would serve a partly applied set of weights.
- ``bucket_index`` (a Miles extension; 0 for an update's first bucket) makes the
  sequence explicit. Index 0 always begins a new update: a staged one is the
  leftover of a sender that restarted, and is discarded and logged. Index k > 0
  must follow exactly k staged buckets, else the bucket is refused and the staged
  update discarded (a bucket went missing). Without the index, a bucket continues
  the staged update if there is one and begins a new one otherwise; so a sender
  that restarts a full update without the index collides with its own leftovers at
  the first tensor sent twice: that bucket is refused, everything staged dropped,
  and its next attempt starts clean.
- Whole updates (from disk, from a receiver's ``update``) commit on their own and leave a staged
  update alone: it commits later, on top of whatever the model holds then.

Memory: staging holds at most one copy of each tensor sent so far, cast to the
model's dtype and placed on the model's device (so the commit is a plain
device-local copy); for a full update that is one extra copy of the model, freed
at commit or discard. A tensor sent twice in one update is refused.

The weight checker (``/weights_checker``) fills the model's floating-point tensors
with seeded noise (``reset_tensors``) and reports a digest of every tensor
(``checksum``, see :mod:`miles.engines.digest`), so a trainer can prove that an
update reached every tensor. Tensors shared by several names (tied embeddings)
appear once, under the first name in ``state_dict`` order: the name
``named_parameters()`` keeps, e.g. ``model.embed_tokens.weight`` and not
``lm_head.weight``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles.engines.weight_group import WeightGroup

log = logging.getLogger("miles.engines.embedded")

# safetensors' dtype codes (a file header's "dtype" field) and the torch dtypes they name.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _StagedUpdate:
    """The buckets of an update whose last bucket (the one with ``weight_version``) has not come yet."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    bucket_of: dict[str, int] = field(default_factory=dict)  # which bucket brought each tensor
    buckets: int = 0
    nbytes: int = 0
    last_seen: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return f"{self.buckets} bucket(s), {len(self.tensors)} tensor(s), {self.nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class BucketOutcome:
    """What one bucket did: staged (``committed`` False) or committed the whole update."""

    committed: bool
    bucket_tensors: int  # tensors in this bucket
    total_tensors: int  # staged so far, or committed
    buckets: int  # buckets staged so far, or in the committed update

    @property
    def message(self) -> str:
        if self.committed:
            return f"Updated {self.total_tensors} tensors from {self.buckets} bucket(s)."
        return (
            f"Staged bucket {self.buckets - 1} ({self.bucket_tensors} tensors; {self.total_tensors} staged in "
            "all). The model is unchanged until the bucket carrying weight_version commits the update."
        )


class _CpuTensors(Mapping[str, torch.Tensor]):
    """The model's tensors as CPU tensors: copied off an accelerator only when read, not at all on CPU."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach().to("cpu")

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class WeightUpdater:
    """All changes to the model's weights. ``lock`` serializes them; commits also take ``step_lock``.

    ``step_lock`` is the scheduler's (held for every decode step), ``get_version`` /
    ``set_version`` read and set the engine's weight version. ``on_change`` is called,
    under ``step_lock``, after every write to the model's tensors (the engine drops its
    prefix cache there: KV computed by the old weights must not be reused).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        step_lock: threading.Lock,
        get_version: Callable[[], str],
        set_version: Callable[[str], None],
        handoff_dir: str | None = None,
        update_timeout_s: float = 300.0,
        on_change: Callable[[], object] | None = None,
        on_commit: Callable[[Sequence[str], str], object] | None = None,
    ) -> None:
        if update_timeout_s <= 0:
            raise ValueError(f"update_timeout_s must be > 0, got {update_timeout_s}")
        self.model = model
        # state_dict(keep_vars) also lists tied aliases (lm_head.weight when tied to the embeddings).
        self.targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.unique, self.canonical = _dedupe(self.targets)
        self.handoff_dir = Path(handoff_dir).resolve() if handoff_dir else None
        self.update_timeout_s = float(update_timeout_s)
        self.groups: dict[str, WeightGroup] = {}
        self.lock = threading.Lock()  # one update at a time, in arrival order
        self._step_lock = step_lock
        self._get_version = get_version
        self._set_version = set_version
        self._on_change = on_change
        self._on_commit = on_commit  # (names written, version) after an update with a version commits
        self._staged: _StagedUpdate | None = None
        self._dropped: str | None = None  # why a staged update was dropped without telling its sender
        self._timer: threading.Timer | None = None
        self._timer_serial = 0

    # --------------------------------------------------------------- checking

    def check(
        self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]], *, exact_dtype: bool = False
    ) -> None:
        """Raise WeightUpdateError for the first tensor that does not fit the model.

        Floating-point tensors may come in another floating-point dtype (they are cast)
        unless ``exact_dtype``.
        """
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
            castable = dtype.is_floating_point and target.dtype.is_floating_point and not exact_dtype
            if dtype != target.dtype and not castable:
                raise WeightUpdateError(f"tensor {name!r} has dtype {dtype}, the model's is {target.dtype}")

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked tensors in. The caller holds the scheduler's step lock."""
        try:
            with torch.no_grad():
                for name, value in tensors.items():
                    self.targets[name].copy_(value)
        finally:  # even a copy that failed halfway may have changed some tensors
            self._changed()

    def _changed(self) -> None:
        """Every write to the model's tensors ends here (under the step lock)."""
        if self._on_change is not None:
            self._on_change()

    def _commit(self, tensors: Mapping[str, torch.Tensor], weight_version: str | None) -> None:
        """The only moment generation pauses: between two scheduler steps."""
        with self._step_lock:
            self.apply(tensors)
            if weight_version is not None:
                self._set_version(weight_version)
                if self._on_commit is not None:
                    self._on_commit(list(tensors), weight_version)

    # ------------------------------------------------------- named extras

    def add_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make more tensors (a LoRA adapter's) updatable and checkable by name. The caller holds
        ``lock`` and the step lock."""
        clash = sorted(n for n in tensors if n in self.targets)
        if clash:
            raise WeightUpdateError(f"tensor names {clash[:3]} are already the model's")
        for name, t in tensors.items():
            self.targets[name] = self.unique[name] = t
            self.canonical[name] = name

    def remove_tensors(self, names: Iterable[str]) -> None:
        """Forget tensors :meth:`add_tensors` added (the caller holds ``lock`` and the step lock)."""
        for name in names:
            self.targets.pop(name, None)
            self.unique.pop(name, None)
            self.canonical.pop(name, None)

    # --------------------------------------------------------- whole updates

    @property
    def version(self) -> str:
        """The engine's weight version (a reader called by ``update`` sees the one its update replaces)."""
        return self._get_version()

    def cpu_tensors(self) -> Mapping[str, torch.Tensor]:
        """The model's distinct tensors by name, as CPU tensors copied only when read (none on a CPU engine).

        What a receiver verifies an update against (e.g. the base of a disk delta).
        """
        return _CpuTensors(self.unique)

    def update(self, read: Callable[[], dict[str, torch.Tensor]], weight_version: str | None) -> int:
        """Read a complete update (checked by ``read``) and commit it; returns the number of tensors."""
        with self.lock:
            tensors = read()
            self._commit(tensors, weight_version)
            return len(tensors)

    # ------------------------------------------------------- bucketed updates

    def update_bucket(
        self,
        read: Callable[[], dict[str, torch.Tensor]],
        *,
        weight_version: str | None,
        bucket_index: int | None = None,
    ) -> BucketOutcome:
        """Take one bucket of a multi-bucket update: stage it, or (with ``weight_version``) commit all.

        ``read`` receives and checks the bucket; it always runs, even for a bucket that
        is refused, because a broadcast must be drained or the sender stays blocked.
        """
        with self.lock:
            self._expire_if_idle()
            refusal = self._refusal(bucket_index)
            staged = self._staged
            try:
                tensors = read()
                if refusal is not None:
                    raise WeightUpdateError(refusal)
                staged = staged or _StagedUpdate()
                self._add(staged, tensors)
            except BaseException as exc:
                if self._staged is not None:
                    self._discard(f"bucket {self._staged.buckets} failed: {exc}")
                    if isinstance(exc, WeightUpdateError):
                        raise WeightUpdateError(
                            f"{exc}; the update's earlier buckets are discarded too"
                        ) from exc
                raise
            if weight_version is None:
                self._staged = staged
                self._arm_timer()
                return BucketOutcome(False, len(tensors), len(staged.tensors), staged.buckets)
            self._staged = None
            self._cancel_timer()
            self._commit(staged.tensors, weight_version)
            return BucketOutcome(True, len(tensors), len(staged.tensors), staged.buckets)

    def _refusal(self, bucket_index: int | None) -> str | None:
        """Why a bucket at this position cannot be taken (None: it can); may discard the staged update."""
        staged = self._staged
        if bucket_index == 0:
            self._dropped = None
            if staged is not None:
                self._discard("a new update began (bucket_index 0) before its last bucket came")
            return None
        if bucket_index is not None:
            have = staged.buckets if staged is not None else 0
            if bucket_index == have:
                return None
            why = f" ({self._dropped})" if staged is None and self._dropped else ""
            self._dropped = None
            if staged is not None:
                self._discard(f"bucket_index {bucket_index} arrived after {have} staged bucket(s)")
            return (
                f"bucket_index {bucket_index} does not continue the staged update, which holds {have} "
                f"bucket(s){why}; the bucket is refused and nothing staged is kept; resend the update from "
                "bucket_index 0"
            )
        if staged is None and self._dropped is not None:
            why, self._dropped = self._dropped, None
            return (
                f"{why}. This bucket may be the rest of that update, so it is refused (once) rather than "
                "committed alone; resend the whole update (sending bucket_index avoids this ambiguity)"
            )
        return None

    def _add(self, staged: _StagedUpdate, tensors: Mapping[str, torch.Tensor]) -> None:
        for name in tensors:
            if name in staged.tensors:
                raise WeightUpdateError(
                    f"tensor {name!r} was already sent in bucket {staged.bucket_of[name]} of this update"
                )
        for name, value in tensors.items():
            target = self.targets[name]
            staged.tensors[name] = value.to(device=target.device, dtype=target.dtype)
            staged.bucket_of[name] = staged.buckets
            staged.nbytes += target.numel() * target.element_size()
        staged.buckets += 1
        staged.last_seen = time.monotonic()

    def _discard(self, why: str, *, sender_told: bool = True) -> None:
        staged, self._staged = self._staged, None
        self._cancel_timer()
        if staged is None:
            return
        message = f"staged weight update discarded ({staged.describe()}): {why}"
        log.warning("%s; the model is unchanged", message)
        if not sender_told:
            self._dropped = message

    def _expire_if_idle(self) -> None:
        staged = self._staged
        if staged is not None and time.monotonic() - staged.last_seen >= self.update_timeout_s:
            self._discard(f"no bucket for update_timeout_s = {self.update_timeout_s:g} s", sender_told=False)

    def _arm_timer(self, delay: float | None = None) -> None:
        """Discard the staged update if no bucket follows in time (frees its memory without waiting)."""
        self._cancel_timer()
        self._timer_serial += 1
        timer = threading.Timer(
            self.update_timeout_s if delay is None else delay, self._on_timer, args=(self._timer_serial,)
        )
        timer.daemon = True
        timer.name = "miles-weight-staging-timeout"
        self._timer = timer
        timer.start()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _on_timer(self, serial: int) -> None:
        with self.lock:
            if serial != self._timer_serial or self._staged is None:
                return  # a later bucket re-armed the timer, or the update is gone
            self._expire_if_idle()
            if self._staged is not None:  # woke a little early: wait for the rest
                self._arm_timer(
                    max(self.update_timeout_s - (time.monotonic() - self._staged.last_seen), 0.01)
                )

    def close(self) -> None:
        """Drop any staged update and its timer (engine shutdown; does not wait for an update in flight)."""
        self._staged = None
        self._cancel_timer()

    # ------------------------------------------------------- weights checker

    def _resolve_skip(self, skip: Sequence[str]) -> set[str]:
        unknown = sorted(n for n in skip if n not in self.canonical)
        if unknown:
            raise WeightUpdateError(
                f"skip names tensors this model does not have: {unknown[:5]} (names are the model's state_dict "
                f"names, e.g. {next(iter(self.canonical), '')!r})"
            )
        return {self.canonical[n] for n in skip}

    def reset_tensors(
        self, skip: Sequence[str] = (), seed: int = 0, only: Sequence[str] | None = None
    ) -> tuple[list[str], list[str]]:
        """Fill every floating-point tensor not in ``skip`` (of ``only``, when given) with noise from ``seed``.

        Returns ``(reset, untouched)`` names. The weight version is left as it is. Meant
        for the weight-equality check: a later update that misses a tensor leaves noise.
        """
        skipped = self._resolve_skip(skip)
        gen = torch.Generator().manual_seed(int(seed))
        reset: list[str] = []
        untouched: list[str] = []
        with self.lock, self._step_lock, torch.no_grad():
            try:
                for name, tensor in self.unique.items():
                    if only is not None and name not in only:
                        continue
                    if name in skipped or not tensor.is_floating_point():
                        untouched.append(name)
                        continue
                    tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32))
                    reset.append(name)
            finally:
                self._changed()
        log.warning("weights checker: %d tensors filled with random values (seed %d)", len(reset), seed)
        return reset, untouched

    def checksums(
        self, skip: Sequence[str] = (), only: Sequence[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """``{name: {dtype, shape, digest}}`` of every state-dict tensor not in ``skip`` (tied ones once)."""
        from miles.engines.digest import tensor_digest

        skipped = self._resolve_skip(skip)
        with self.lock:  # updates wait; generation goes on (it never writes weights)
            return {
                name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "digest": tensor_digest(t)}
                for name, t in self.unique.items()
                if name not in skipped and (only is None or name in only)
            }

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
            # With output_loading_info it returns (model, info); transformers' annotation says the model alone.
            loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
            fresh, info = loaded
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
                        if code not in SAFETENSORS_DTYPES:
                            raise WeightUpdateError(
                                f"tensor {key!r} in {path.name!r} has unsupported dtype {code}"
                            )
                        specs.append((key, list(piece.get_shape()), SAFETENSORS_DTYPES[code]))
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
        self,
        group: WeightGroup,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        flat: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Receive one bucket: a broadcast per tensor, or one of all its bytes (``flat``, see ``flat_layout``)."""
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
        received: dict[str, torch.Tensor] = {}
        if flat:
            from miles.engines.weight_group import flat_layout

            sizes = [
                math.prod(int(s) for s in shape) * dtype.itemsize
                for shape, dtype in zip(shapes, parsed, strict=True)
            ]
            offsets, total = flat_layout(sizes)
            buf = torch.empty(total, dtype=torch.uint8, device=group.device)
            group.broadcast(buf, src=0)
            for name, shape, dtype, off, n in zip(names, shapes, parsed, offsets, sizes, strict=True):
                received[name] = buf[off : off + n].view(dtype).view([int(s) for s in shape])
        else:
            for name, shape, dtype in zip(names, shapes, parsed, strict=True):
                buf = torch.empty([int(s) for s in shape], dtype=dtype, device=group.device)
                group.broadcast(buf, src=0)
                received[name] = buf
        if problem is not None:
            raise WeightUpdateError(
                f"{problem} (the broadcast was received and discarded; the model is unchanged)"
            )
        return received

    def describe(self) -> dict[str, Any]:
        staged = self._staged
        return {
            "groups": sorted(self.groups),
            "handoff_dir": str(self.handoff_dir) if self.handoff_dir else None,
            "update_timeout_s": self.update_timeout_s,
            "staged_update": None
            if staged is None
            else {"buckets": staged.buckets, "tensors": len(staged.tensors), "bytes": staged.nbytes},
        }


def _dedupe(targets: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(unique, canonical)``: one entry per distinct tensor (first name wins) and every name -> that name.

    Two names are aliases when they are the same memory: same start, dtype, shape and strides.
    """
    unique: dict[str, torch.Tensor] = {}
    canonical: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, t in targets.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() > 0 and key in first:  # empty tensors may share a null pointer without being aliases
            canonical[name] = first[key]
            continue
        first[key] = name
        unique[name] = t
        canonical[name] = name
    return unique, canonical
