"""What the diffusers-pipeline families (SD3, Wan, Qwen-Image, LTX-Video, Cosmos) share: a trainable ``transformer`` prompted by
text, frozen text encoders and VAE kept off the module tree, each prompt encoded alone once and
kept, and a forward under the recipe's precision. A family gives its encodings type, how one text
is encoded (``_encode_text``) and how its transformer is called (``_denoise``). The video families
(:class:`VideoLatentsFlowModel`) and the image ones (:class:`ImageLatentsFlowModel`) share their
sizes; :func:`prompted_model` builds any one-text-encoder family's model from its loaded parts."""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, cast

import torch
from torch import nn

from miles_diffusion.denoiser import Conditioning, DiffusionModel
from miles_diffusion.pipeline_parts import TextPipeline, filmstrip
from miles_diffusion.precision import PrecisionConfig, keep_fp32

UNCONDITIONAL_TEXT = ""
"""The prompt whose encoding is the unconditional branch of classifier-free guidance."""


class FrozenParts(Protocol):
    """The parts that never train, kept off the module tree on purpose: not in the optimizer, the
    weight updates or the checkpoints, never sharded."""

    def modules(self) -> dict[str, nn.Module]: ...


class PipelineFlowModel(DiffusionModel):
    """A pipeline family's transformer as a rectified-flow velocity model, prompted by id or text.

    Every subclass is served and trained alike on the core path: the engine encodes request texts
    with :meth:`encode_texts`; the backend trains, checkpoints and sends the transformer alone (the
    frozen parts are the base directory's), and exports a whole pipeline directory."""

    encodings_type: ClassVar[Any]
    """The family's encodings: a frozen dataclass with ``__len__``, ``__getitem__`` and ``cat`` (a
    :class:`~miles_diffusion.pipeline_parts.TensorFields`)."""

    def __init__(
        self,
        transformer: nn.Module,
        frozen: FrozenParts,
        prompts: tuple[str, ...],
        *,
        scheduler: Any,
        precision: PrecisionConfig | None = None,
    ) -> None:
        super().__init__()
        # An engine loads the model without a prompt list: its requests bring the texts
        # (encode_texts); a trainer gets the recipe's list (families.load_model requires one).
        self.transformer = transformer
        self._frozen = frozen  # a plain attribute, not a submodule: see FrozenParts
        for module in frozen.modules().values():
            module.requires_grad_(False).eval()
        self.prompts = tuple(prompts)
        self.scheduler = scheduler
        """The directory's scheduler: only its sigmas are read."""
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        self.precision = precision or PrecisionConfig()
        self._encoded: dict[str, Any] = {}
        self.fp32_modules = keep_fp32(self, self.precision.fp32_modules)
        """Modules (names under ``transformer.``) computed in FP32 under a BF16/FP16 ``precision``."""

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def frozen_modules(self) -> dict[str, nn.Module]:
        return self._frozen.modules()

    @torch.no_grad()
    def encode_prompts(self, prompts: torch.Tensor) -> Any:
        if prompts.is_floating_point() or prompts.ndim != 1:
            raise ValueError(
                f"encode_prompts takes [B] integer prompt ids, got {prompts.dtype} {tuple(prompts.shape)}"
            )
        ids = [int(i) for i in prompts.tolist()]
        bad = sorted({i for i in ids if not 0 <= i < self.num_prompts})
        if bad:
            raise ValueError(f"prompt ids {bad} are outside this recipe's prompts 0..{self.num_prompts - 1}")
        return self.encode_texts([self.prompts[i] for i in ids])

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Any:
        """The conditioning of ``texts``, each distinct text encoded alone (a batch of one) the first
        time it is asked for and kept: the engine's form (its requests bring the texts), equal bit
        for bit to :meth:`encode_prompts` of the same texts by id."""
        for text in dict.fromkeys(texts):
            if text not in self._encoded:
                self._encoded[text] = self._encode_text(text)
        return self.encodings_type.cat([self._encoded[t] for t in texts])

    has_unconditional = True
    """The unconditional branch is the empty prompt through the family's own text encoders (the
    negative prompt diffusers' SD3 and Wan pipelines guide with by default)."""

    unconditional_text: ClassVar[str] = UNCONDITIONAL_TEXT
    """The text whose encoding is the unconditional branch (a family may guide against another)."""

    def with_unconditional(self, prompts: Conditioning) -> Any:
        """[the unconditional text's rows; the prompts' rows]."""
        enc = self._as_encodings(prompts)
        # encode_texts keeps the unconditional text's encoding after its first use, as every text's
        null = self.encode_texts([self.unconditional_text] * len(enc))
        return self.encodings_type.cat([null, enc])

    def _as_encodings(self, prompts: Conditioning) -> Any:
        """``prompts`` as the family's encodings: encoded if they are ids."""
        if isinstance(prompts, self.encodings_type):
            return prompts
        assert isinstance(prompts, torch.Tensor)
        return self.encode_prompts(prompts)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, prompts: Conditioning) -> torch.Tensor:
        """``x_t``: latents [B, ...]; ``t``: [B] in [0, 1]; ``prompts``: ids [B] or the family's
        encodings. Returns the velocity, shaped as ``x_t`` (FP32)."""
        enc = self._as_encodings(prompts)
        if len(enc) != x_t.shape[0]:
            raise ValueError(f"{len(enc)} prompt encodings for {x_t.shape[0]} latents")
        timestep = t * float(self.num_train_timesteps)
        if self.precision.dtype is torch.float32:
            return self._denoise(x_t, timestep, enc)
        with torch.autocast(device_type=x_t.device.type, dtype=self.precision.dtype):
            out = self._denoise(x_t, timestep, enc)
        return out.float()

    @abstractmethod
    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: Any) -> torch.Tensor:
        """The family's transformer on latents ``x_t`` at ``timestep`` (scheduler scale) under ``enc``."""

    @abstractmethod
    def _encode_text(self, text: str) -> Any:
        """One prompt's encodings (a batch of one), with autocast off (frozen FP32 encoders)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> PipelineFlowModel:
        """A copy of the trainable transformer (a frozen reference model for a KL term) that shares
        the frozen text encoders and VAE instead of copying them."""
        memo[id(self._frozen)] = self._frozen
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> PipelineFlowModel:
        """``.to(device)`` and friends move the frozen parts too (they are not submodules)."""
        super()._apply(fn, recurse)
        for module in self._frozen.modules().values():
            module._apply(fn)
        self._encoded.clear()
        return self


class VideoLatentsFlowModel(PipelineFlowModel):
    """A family whose latents are one video ``[C, F, h, w]`` (Wan, LTX-Video), sized by the
    directory's size file (``video``: num_frames, height, width and what else the family reads), and
    whose videos reach the image rewards as filmstrips."""

    def __init__(self, *args: Any, video: dict[str, int], **kwargs: Any) -> None:
        """:class:`PipelineFlowModel`'s arguments and the ``video`` sizes."""
        super().__init__(*args, **kwargs)
        self.video = dict(video)

    @abstractmethod
    def to_videos(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents to videos [B, 3, frames, H, W] in [0, 1]."""

    @torch.no_grad()
    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Each video's frames side by side: one filmstrip image [B, 3, H, frames * W] per video
        (what the image rewards score: a reward of the whole video, one per trajectory)."""
        return filmstrip(self.to_videos(latents))


class ImageLatentsFlowModel(PipelineFlowModel):
    """A family whose latents are one image ``[C, h, w]`` through a Wan-style VAE (Qwen-Image,
    Cosmos-Predict2), sized by the directory's size file (``image``: height, width,
    max_sequence_length)."""

    def __init__(self, *args: Any, image: dict[str, int], **kwargs: Any) -> None:
        """:class:`PipelineFlowModel`'s arguments and the ``image`` sizes."""
        super().__init__(*args, **kwargs)
        self.image = dict(image)
        self.max_sequence_length = int(image["max_sequence_length"])

    @property
    def vae_scale_factor(self) -> int:
        # the pipelines' rule: one 2x spatial step per temporal-downsample entry of the VAE
        return 2 ** len(cast(Any, self._frozen).vae.config.temperal_downsample)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        z_dim = int(cast(Any, self._frozen).vae.config.z_dim)
        s = self.vae_scale_factor
        return (z_dim, self.image["height"] // s, self.image["width"] // s)


Model = TypeVar("Model", bound=PipelineFlowModel)


def prompted_model(
    model_class: Callable[..., Model],
    loaded: TextPipeline,
    prompts: Sequence[str],
    precision: PrecisionConfig | None,
    **sizes: dict[str, int],
) -> Model:
    """A one-text-encoder family's model over its loaded directory, in eval mode: each such family
    builds it alike from the same parts; only the keyword of its size dict (``video``, ``image``)
    is its own, given in ``sizes``."""
    model = model_class(
        loaded.transformer,
        loaded.frozen,
        tuple(prompts),
        scheduler=loaded.scheduler,
        precision=precision,
        **sizes,
    )
    return model.eval()
