"""Model families: which loader reads a model directory, picked from the directory itself.

A family recognises its directories by their files (``detect``) and loads one into a
:class:`~miles_diffusion.denoiser.DiffusionModel` (``load``). Registered:

- ``tiny-flow-unet``: a ``config.json`` whose ``architecture`` is ``MilesTinyFlowUNet`` (the
  package's tiny pixel-space UNet, :mod:`miles_diffusion.model`);
- ``sd3``: a diffusers directory whose ``model_index.json`` names ``StableDiffusion3Pipeline``
  (SD3 / SD3.5, :mod:`miles_diffusion.sd3`; its recipes give the prompt texts);
- ``wan``: a diffusers directory whose ``model_index.json`` names ``WanPipeline`` (Wan 2.x
  text-to-video, :mod:`miles_diffusion.wan`; the driver and the core path both serve it);
- ``qwen-image``: a diffusers directory whose ``model_index.json`` names ``QwenImagePipeline``
  (Qwen-Image text-to-image, :mod:`miles_diffusion.qwen_image`; the driver and the core path).
- ``cosmos``: a diffusers directory whose ``model_index.json`` names ``Cosmos2TextToImagePipeline``
  (Cosmos-Predict2 text-to-image, :mod:`miles_diffusion.cosmos`; the driver and the core path);
- ``ltx``: a diffusers directory whose ``model_index.json`` names ``LTXPipeline`` (LTX-Video
  text-to-video, :mod:`miles_diffusion.ltx`; the driver and the core path).

Any other directory, a diffusers pipeline of another class included, is refused with one error
naming what is supported. ``register_family`` adds one (a plug-in registers at import).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.precision import PrecisionConfig

if TYPE_CHECKING:
    from miles_diffusion.sequence_parallel import SequenceSplit


@dataclass(frozen=True)
class ModelFamily:
    name: str
    recognises: str
    """What a directory of this family holds (shown when a directory matches no family)."""
    detect: Callable[[Path], bool]
    load: Callable[[Path, PrecisionConfig | None, tuple[str, ...]], DiffusionModel]
    """(directory, precision, prompt texts) -> the model, in eval mode."""
    text_prompts: bool
    """Whether prompts are texts (the recipe's ``prompts:`` list) rather than bare ids."""
    unconditional: bool = False
    """Whether the family has an unconditional branch for classifier-free guidance (its models'
    ``has_unconditional``): known from the directory, so a guidance scale is judged before loading."""
    sequence_split: Callable[[Path], SequenceSplit] | None = None
    """What a sequence-parallel forward of the directory's transformer splits, from its config files
    (:mod:`miles_diffusion.sequence_parallel`); None: the family has no sequence parallelism."""


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    if family.name in _FAMILIES and _FAMILIES[family.name] != family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family


def _load_tiny(path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]) -> DiffusionModel:
    from miles_diffusion.model import load_pretrained

    return load_pretrained(path, precision)


def _detect_tiny(path: Path) -> bool:
    from miles_diffusion.model import ARCHITECTURE, CONFIG_FILE

    try:
        data = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("architecture") == ARCHITECTURE


def _load_sd3(path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]) -> DiffusionModel:
    from miles_diffusion.sd3 import load_sd3

    return load_sd3(path, precision, prompts)


def _detect_sd3(path: Path) -> bool:
    from miles_diffusion.sd3 import is_sd3_directory

    return is_sd3_directory(path)


def _load_wan(path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]) -> DiffusionModel:
    from miles_diffusion.wan import load_wan

    return load_wan(path, precision, prompts)


def _detect_wan(path: Path) -> bool:
    from miles_diffusion.wan import is_wan_directory

    return is_wan_directory(path)


def _load_qwen_image(
    path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]
) -> DiffusionModel:
    from miles_diffusion.qwen_image import load_qwen_image

    return load_qwen_image(path, precision, prompts)


def _detect_qwen_image(path: Path) -> bool:
    from miles_diffusion.qwen_image import is_qwen_image_directory

    return is_qwen_image_directory(path)


def _load_ltx(path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]) -> DiffusionModel:
    from miles_diffusion.ltx import load_ltx

    return load_ltx(path, precision, prompts)


def _detect_ltx(path: Path) -> bool:
    from miles_diffusion.ltx import is_ltx_directory

    return is_ltx_directory(path)


def _load_cosmos(path: Path, precision: PrecisionConfig | None, prompts: tuple[str, ...]) -> DiffusionModel:
    from miles_diffusion.cosmos import load_cosmos

    return load_cosmos(path, precision, prompts)


def _wan_split(path: Path) -> SequenceSplit:
    from miles_diffusion.wan import wan_sequence_split

    return wan_sequence_split(path)


def _detect_cosmos(path: Path) -> bool:
    from miles_diffusion.cosmos import is_cosmos_directory

    return is_cosmos_directory(path)


register_family(
    ModelFamily(
        "tiny-flow-unet",
        "config.json with architecture 'MilesTinyFlowUNet'",
        _detect_tiny,
        _load_tiny,
        text_prompts=False,
    )
)
register_family(
    ModelFamily(
        "sd3",
        "a diffusers directory whose model_index.json names StableDiffusion3Pipeline",
        _detect_sd3,
        _load_sd3,
        text_prompts=True,
        unconditional=True,
    )
)
register_family(
    ModelFamily(
        "wan",
        "a diffusers directory whose model_index.json names WanPipeline",
        _detect_wan,
        _load_wan,
        text_prompts=True,
        unconditional=True,
        sequence_split=_wan_split,
    )
)
register_family(
    ModelFamily(
        "qwen-image",
        "a diffusers directory whose model_index.json names QwenImagePipeline",
        _detect_qwen_image,
        _load_qwen_image,
        text_prompts=True,
        unconditional=True,  # Qwen-Image's norm-rescaled "true CFG" against " " (qwen_image.py)
    )
)
register_family(
    ModelFamily(
        "ltx",
        "a diffusers directory whose model_index.json names LTXPipeline",
        _detect_ltx,
        _load_ltx,
        text_prompts=True,
        unconditional=True,  # LTXPipeline's CFG with the empty negative prompt (ltx.py)
    )
)

register_family(
    ModelFamily(
        "cosmos",
        "a diffusers directory whose model_index.json names Cosmos2TextToImagePipeline",
        _detect_cosmos,
        _load_cosmos,
        text_prompts=True,
        unconditional=True,  # the pipeline's CFG on x_0 is the shared one at w + 1 (cosmos.py)
    )
)


def families() -> dict[str, ModelFamily]:
    return dict(_FAMILIES)


def supported() -> str:
    """One line naming every family and what it recognises."""
    return "; ".join(f"{f.name} ({f.recognises})" for f in _FAMILIES.values())


def _describe(path: Path) -> str:
    index = path / "model_index.json"
    if index.is_file():
        try:
            name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
        except (OSError, ValueError, AttributeError):
            name = None
        return f"a diffusers {name or 'pipeline'} directory"
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
            kind = data.get("architecture") or data.get("architectures") or data.get("_class_name")
        except (OSError, ValueError, AttributeError):
            kind = None
        return f"a model directory of {kind!r}" if kind else "a model directory of an unknown architecture"
    return "a directory with neither model_index.json nor config.json"


def family_for(directory: str | Path) -> ModelFamily:
    """The family that loads ``directory``; one ValueError naming the supported ones if none does."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {str(directory)!r} is not a directory")
    for family in _FAMILIES.values():
        if family.detect(path):
            return family
    raise ValueError(f"{directory}: {_describe(path)}; miles-diffusion loads: {supported()}")


def load_model(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> DiffusionModel:
    """The model in ``directory``, by its family (the tiny UNet ignores ``prompts``; a text family
    needs them)."""
    family = family_for(directory)
    if prompts and not family.text_prompts:
        raise ValueError(
            f"{directory}: the {family.name} family is prompted by id only; the recipe's `prompts:` "
            "list applies to text families (sd3, wan)"
        )
    if family.text_prompts and not prompts:
        raise ValueError(
            f"the {family.name} family is prompted with text: the recipe needs a non-empty `prompts:` list "
            "(prompt id i is prompts[i])"
        )
    return family.load(Path(directory).expanduser(), precision, tuple(prompts))


def check_family_guidance(family: ModelFamily, guidance_scale: float) -> None:
    """Refuse a guidance scale above 1 for a family with no unconditional branch (before loading)."""
    from miles_diffusion.guidance import check_unconditional

    check_unconditional(f"the {family.name} family", family.unconditional, guidance_scale)


def load_for_engine(
    directory: str | Path, precision: PrecisionConfig | None = None
) -> tuple[ModelFamily, DiffusionModel]:
    """The model an engine serves: a text family is loaded without a prompt list (each request
    brings the texts of its prompt ids, and the engine encodes those). ``precision``: the forward
    pass's compute dtype (default FP32)."""
    family = family_for(directory)
    return family, family.load(Path(directory).expanduser(), precision, ())


CORE_PATH_FAMILIES = frozenset({"tiny-flow-unet", "sd3", "wan", "qwen-image", "ltx", "cosmos"})
"""The families the core path (``miles run``: the diffusion engine and backend) serves so far."""

_BUILTIN_ARCHITECTURES = {
    "MilesTinyFlowUNet": "tiny-flow-unet",
    "StableDiffusion3Pipeline": "sd3",
    "WanPipeline": "wan",
    "QwenImagePipeline": "qwen-image",
    "LTXPipeline": "ltx",
    "Cosmos2TextToImagePipeline": "cosmos",
}
"""The family of a built-in diffusion model, by its declared architecture (judged without building it)."""


TWO_EXPERT_BUILTINS = frozenset({"tiny-wan22-a14b"})
"""Built-in diffusion models that are two-expert Wan 2.2 directories (judged without building them)."""


def _core_path_refusal(where: str, family: str) -> str:
    return (
        f"{where}: a {family} model; the core path (miles run: the diffusion engine and backend) serves "
        f"{', '.join(sorted(CORE_PATH_FAMILIES))} models so far; run the {family} family's recipes with "
        "python -m miles_diffusion.train (docs/diffusion.md, 'Model families')"
    )


def check_core_path(directory: str | Path) -> ModelFamily:
    """The family of ``directory`` if the engine and backend serve it; else one ValueError."""
    family = family_for(directory)
    if family.name not in CORE_PATH_FAMILIES:
        raise ValueError(_core_path_refusal(str(directory), family.name))
    if family.name == "wan":
        from miles_diffusion.wan import is_two_expert_directory, two_expert_refusal

        if is_two_expert_directory(Path(directory)):
            raise ValueError(two_expert_refusal(str(directory), "the core path (miles run)"))
    return family


def check_core_model_ref(ref: str) -> None:
    """``model.path`` of a ``miles run`` recipe (a directory or ``builtin:NAME``), checked before the
    core resolves it: a model directory of a family the core path does not serve is refused by name
    (a built-in is judged by its declared architecture, without building it)."""
    from miles.models.registry import BUILTIN_PREFIX, builtin_models

    if ref.startswith(BUILTIN_PREFIX):
        spec = builtin_models().get(ref[len(BUILTIN_PREFIX) :])
        family = (
            _BUILTIN_ARCHITECTURES.get(spec.architecture)
            if spec is not None and spec.kind == "diffusion"
            else None
        )
        if family is not None and family not in CORE_PATH_FAMILIES:
            raise ValueError(_core_path_refusal(f"model.path {ref}", family))
        if spec is not None and spec.name in TWO_EXPERT_BUILTINS:
            from miles_diffusion.wan import two_expert_refusal

            raise ValueError(two_expert_refusal(f"model.path {ref}", "the core path (miles run)"))
        return
    path = Path(ref).expanduser()
    if path.is_dir() and (path / "model_index.json").is_file():
        check_core_path(path)
