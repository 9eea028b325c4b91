"""The model-family seam and the Stable Diffusion 3 family on its scaled-down proxy (builtin:tiny-sd3):
the directory picks its family, the conditioning is SD3's (checked against diffusers' own pipeline),
the sampler's log-probabilities are the trainer's re-scoring bit for bit, only the transformer trains,
and deterministic mode checks the text encoders too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_diffusion.deterministic import check_attention_backends
from miles_diffusion.families import family_for, load_model
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, save_pretrained
from miles_diffusion.nft import DiffusionNFTConfig, DiffusionNFTTrainer
from miles_diffusion.objectives import Rollout, TrainerConfig
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.recipe import recipe_from_dict
from miles_diffusion.sampler import SamplerConfig, sample, sample_seeded, step_log_prob
from miles_diffusion.sd3 import T5_MAX_LENGTH, SD3Encodings, SD3FlowModel, write_byte_clip_tokenizer
from miles_diffusion.train import main
from miles_diffusion.trainer import FlowGRPOTrainer

from ._family_checks import frozen_state, proxy_fixtures

PROMPTS = ("a photo of a red apple", "a lighthouse at dusk", "Ünïcode, punctuation & CAPS!")


proxy_dir, model = proxy_fixtures("builtin:tiny-sd3", PROMPTS, SD3FlowModel)


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "sd3"
    tiny = save_pretrained(build_tiny_model(TinyFlowModelConfig(), 0), tmp_path / "tiny")
    assert family_for(tiny).name == "tiny-flow-unet"
    other = tmp_path / "flux"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError) as err:
        family_for(other)
    message = str(err.value)
    assert "a diffusers FluxPipeline directory" in message
    assert "sd3 (" in message and "StableDiffusion3Pipeline" in message and "tiny-flow-unet (" in message
    with pytest.raises(ValueError, match="text families"):
        load_model(tiny, prompts=("a cat",))
    with pytest.raises(ValueError, match="needs a non-empty `prompts:` list"):
        load_model(proxy_dir)


def test_byte_level_clip_tokenizer(tmp_path: Path) -> None:
    tokenizer = write_byte_clip_tokenizer(tmp_path / "tok")
    ids = tokenizer("A red cube, é!").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert len(tokenizer) == 514 and tokenizer.unk_token_id not in ids[1:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a red cube , é !"
    padded = tokenizer("x", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(padded) == 77 == tokenizer.model_max_length


def test_conditioning_and_schedule_are_sd3s(model: SD3FlowModel, proxy_dir: Path) -> None:
    """diffusers' own StableDiffusion3Pipeline loads the proxy directory (the layout is the real
    one), and its encode_prompt gives our encodings bit for bit; its scheduler's shifted sigmas are
    our schedule."""
    from diffusers import StableDiffusion3Pipeline

    pipe: Any = StableDiffusion3Pipeline.from_pretrained(
        str(proxy_dir), text_encoder_3=None, tokenizer_3=None, dtype=torch.float32
    )
    assert pipe.text_encoder_3 is None
    sequence, _, pooled, _ = pipe.encode_prompt(
        prompt=list(PROMPTS), prompt_2=None, prompt_3=None, do_classifier_free_guidance=False
    )
    ours = model.encode_prompts(torch.arange(len(PROMPTS)))
    assert ours.sequence.shape == (3, 77 + T5_MAX_LENGTH, 32) and ours.pooled.shape == (3, 24)
    # ours encodes each prompt alone (batch-independent); compare row by row with a batch of one
    for i, text in enumerate(PROMPTS):
        seq_i, _, pooled_i, _ = pipe.encode_prompt(
            prompt=text, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False
        )
        assert torch.equal(ours.sequence[i : i + 1], seq_i) and torch.equal(ours.pooled[i : i + 1], pooled_i)
    torch.testing.assert_close(ours.sequence, sequence, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.pooled, pooled, rtol=0, atol=1e-6)
    pipe.scheduler.set_timesteps(8)
    assert torch.equal(model.timestep_schedule(8), pipe.scheduler.sigmas.float())
    assert float(model.timestep_schedule(8)[0]) == 1.0 and float(model.timestep_schedule(8)[-1]) == 0.0
    assert model.latent_shape == (4, 8, 8)


def test_engine_log_probs_equal_the_trainers_rescoring(model: SD3FlowModel) -> None:
    """The engine's form (prompts encoded once per request, rows reused, per-trajectory seeds) and the
    driver's form (ids) both give log-probabilities the trainer re-scores bit for bit at every step."""
    prompts = torch.tensor([2, 0, 2, 1])
    distinct, inverse = torch.unique(prompts, return_inverse=True)
    encoded = model.encode_prompts(distinct)[inverse]
    assert isinstance(encoded, SD3Encodings)
    config = SamplerConfig(num_steps=4, noise_level=0.7)
    engine = sample_seeded(model, prompts, [11, 12, 13, 14], config, encoded=encoded)
    driver = sample(model, prompts, config, torch.Generator().manual_seed(0))
    for trajectory in (engine, driver):
        assert trajectory.latents.shape == (4, 5, 4, 8, 8)
        for step in range(config.num_steps):
            with torch.no_grad():
                rescored, _, _ = step_log_prob(model, trajectory, step, config.noise_level)
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
    again = sample_seeded(model, prompts, [11, 12, 13, 14], config, encoded=encoded)
    assert torch.equal(again.latents, engine.latents)
    images = model.to_images(engine.latents[:, -1])
    assert images.shape == (4, 3, 32, 32) and 0.0 <= float(images.min()) <= float(images.max()) <= 1.0


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    model = load_model(proxy_dir, prompts=PROMPTS)
    assert isinstance(model, SD3FlowModel)
    assert set(model.frozen_modules()) == {"vae", "text_encoder", "text_encoder_2"}
    assert all(name.startswith("transformer.") for name in model.state_dict())  # what updates carry
    assert all(name.startswith("transformer.") for name, _ in model.named_parameters())
    frozen_params = [p for m in model.frozen_modules().values() for p in m.parameters()]
    assert frozen_params and not any(p.requires_grad for p in frozen_params)
    frozen_before = frozen_state(model)
    transformer_before = {k: v.clone() for k, v in model.state_dict().items()}

    trainer = FlowGRPOTrainer(model, FlowGRPOConfig(clip_range=0.05), TrainerConfig(lr=1e-2), 0.7)
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.transformer.parameters()}
    assert not trained & {id(p) for p in frozen_params}
    prompts = torch.tensor([0, 0, 1, 1])
    trajectory = sample(model, prompts, SamplerConfig(num_steps=3), torch.Generator().manual_seed(1))
    stats = trainer.train_step(trajectory, torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 2])
    assert stats["grad_norm"] > 0
    nft = DiffusionNFTTrainer(model, DiffusionNFTConfig(timesteps_per_iteration=2), TrainerConfig(lr=1e-2))
    nft.train_on_rollout(Rollout(trajectory, torch.tensor([0.1, 0.9, 0.4, 0.2]), 2), torch.Generator())

    assert all(p.grad is None for p in frozen_params)
    frozen_after = frozen_state(model)
    assert frozen_after.keys() == frozen_before.keys()
    assert all(torch.equal(frozen_after[k], frozen_before[k]) for k in frozen_before)
    assert all(not m.training for m in model.frozen_modules().values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, transformer_before[k])]
    assert len(changed) > len(transformer_before) // 2


def test_deterministic_mode_checks_processors_and_text_encoders(model: SD3FlowModel) -> None:
    kinds = {type(m.processor).__name__ for m in model.transformer.modules() if hasattr(m, "processor")}
    assert kinds == {"JointAttnProcessor2_0"}
    check_attention_backends(model)
    encoder = model.frozen_modules()["text_encoder_2"]
    before = encoder.config._attn_implementation
    encoder.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="'text_encoder_2' uses the 'flash_attention_2' attention"):
            check_attention_backends(model)
    finally:
        encoder.config._attn_implementation = before


def test_precision_names_transformer_modules(proxy_dir: Path) -> None:
    precision = PrecisionConfig("bfloat16", ("transformer.time_text_embed", "transformer.norm_out.linear"))
    model = load_model(proxy_dir, precision, PROMPTS)
    assert model.fp32_modules == ["transformer.time_text_embed", "transformer.norm_out.linear"]
    v = model(torch.zeros(2, 4, 8, 8), torch.tensor([0.5, 0.9]), torch.tensor([0, 1]))
    assert v.dtype == torch.float32 and v.shape == (2, 4, 8, 8)
    with pytest.raises(ValueError, match="'text_encoder' matches no module"):
        load_model(proxy_dir, PrecisionConfig("bfloat16", ("text_encoder",)), PROMPTS)


def test_recipes_with_prompt_texts() -> None:
    base = {"name": "x", "evidence_level": "not verified"}
    recipe = recipe_from_dict({**base, "model": "builtin:tiny-sd3", "prompts": ["a", "b"]})
    assert recipe.model == "builtin:tiny-sd3" and recipe.prompts == ("a", "b")
    with pytest.raises(ValueError, match="prompts: texts are for a model directory"):
        recipe_from_dict({**base, "prompts": ["a"]})


def test_the_real_recipe_runs_on_the_proxy_directory_and_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sd3_flow_grpo`` unchanged (its prompts, sampler, BF16 precision with FP32 modules named on
    SD3's transformer) but pointed at the proxy's directory, for one iteration."""
    main(["sd3_flow_grpo", "--model", str(proxy_dir), "--iterations", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "recipe sd3_flow_grpo: evidence level not verified" in out
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert {"reward/mean", "train/loss", "eval/reward_before", "eval/reward_after"} <= set(json.loads(line))
    with pytest.raises(ValueError, match="is not a directory"):
        main(["sd3_flow_grpo", "--model", str(tmp_path / "missing"), "--iterations", "1"])


def test_the_core_path_takes_an_sd3_directory_and_refuses_another_pipeline(
    proxy_dir: Path, tmp_path: Path
) -> None:
    """``miles run`` serves the sd3 family: the core's ``model.path`` check accepts the pipeline
    directory through the package's ``miles_model_directory`` hook (no top-level config.json), and
    the recipe checks want its prompt texts; a pipeline of another class is refused in one line
    naming the supported families, by the recipe check and by the engine alike."""
    from miles.config import load_recipe
    from miles.driver.preflight import close_components, preflight
    from miles.errors import ConfigError
    from miles.models.registry import check_model_dir, claimed_directory
    from miles_diffusion.engine.__main__ import main as engine_main

    assert check_model_dir(proxy_dir) == proxy_dir.resolve()
    assert claimed_directory(proxy_dir) == "a sd3 diffusers pipeline directory (miles-diffusion)"
    texts = "rollout.options.prompts=[a cat, a dog, a bird, a fish]"
    for ref in ("builtin:tiny-sd3", str(proxy_dir)):
        close_components(preflight(load_recipe("tiny_flow_grpo", [f"model.path={ref}", texts])).components)
        with pytest.raises(ConfigError, match=r"prompted with text: set rollout.options.prompts"):
            close_components(preflight(load_recipe("tiny_flow_grpo", [f"model.path={ref}"])).components)
    with pytest.raises(ConfigError, match=r"draws 4 prompt ids, but rollout.options.prompts holds 2"):
        preflight(
            load_recipe("tiny_flow_grpo", [f"model.path={proxy_dir}", "rollout.options.prompts=[a, b]"])
        )
    with pytest.raises(ConfigError, match=r"prompted by id only; remove the texts"):
        preflight(load_recipe("tiny_flow_grpo", [texts]))
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert claimed_directory(flux) is None
    with pytest.raises(ConfigError, match=r"a diffusers FluxPipeline directory; miles-diffusion loads: "):
        preflight(load_recipe("tiny_flow_grpo", [f"model.path={flux}"]))
    with pytest.raises(SystemExit, match=r"a diffusers FluxPipeline directory"):
        engine_main(["--model", str(flux)])


def test_a_kl_reference_copies_the_transformer_and_shares_the_frozen_parts(model: SD3FlowModel) -> None:
    trainer = FlowGRPOTrainer(model, FlowGRPOConfig(kl_coef=0.1), TrainerConfig(), 0.7)
    reference = trainer.reference
    assert isinstance(reference, SD3FlowModel)
    assert reference.transformer is not model.transformer
    assert all(reference.frozen_modules()[k] is m for k, m in model.frozen_modules().items())
    x, t, ids = torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.8]), torch.tensor([1, 2])
    with torch.no_grad():
        assert torch.equal(reference(x, t, ids), model(x, t, ids))


def test_with_t5_the_conditioning_is_sd3s_too(tmp_path: Path) -> None:
    """The SD3.5 layout carries T5 (``text_encoder_3``, ``tokenizer_3``): a proxy built with one T5
    layer loads, and its encodings equal diffusers' pipeline's bit for bit, T5 states included."""
    from diffusers import StableDiffusion3Pipeline

    from miles_diffusion.sd3 import TinySD3Config, build_tiny_sd3

    build_tiny_sd3(tmp_path / "t5", 0, TinySD3Config(t5_layers=1))
    index = json.loads((tmp_path / "t5" / "model_index.json").read_text())
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    model = load_model(tmp_path / "t5", prompts=PROMPTS[:2])
    assert isinstance(model, SD3FlowModel) and "text_encoder_3" in model.frozen_modules()
    pipe: Any = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "t5"), dtype=torch.float32)
    ours = model.encode_prompts(torch.tensor([1, 0]))
    for row, text in ((0, PROMPTS[1]), (1, PROMPTS[0])):
        with torch.no_grad():  # as the pipeline's own __call__ runs it (SDPA picks its kernel by grad mode)
            sequence, _, pooled, _ = pipe.encode_prompt(
                prompt=text, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False
            )
        assert torch.equal(ours.sequence[row : row + 1], sequence) and torch.equal(
            ours.pooled[row : row + 1], pooled
        )
    assert ours.sequence[:, 77:].abs().sum() > 0  # T5's states, not the zeros of a T5-less directory
    check_attention_backends(model)
    trajectory = sample(
        model, torch.tensor([0, 1]), SamplerConfig(num_steps=2), torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(step_log_prob(model, trajectory, 1, 0.7)[0], trajectory.log_probs[:, 1])
