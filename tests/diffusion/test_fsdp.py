"""FSDP2 data-parallel training (miles_diffusion.fsdp) on CPU over gloo, with two spawned ranks.

One Flow-GRPO ``train_step`` of the tiny UNet, sharded over two ranks that each re-score half of a
fixed set of trajectories on the same steps, leaves the same parameters as the one-process trainer's
step on the same trajectories; so do one DiffusionNFT ``train_on_rollout`` and one SFT
``train_on_batch`` (every rank drawing the whole batch's noise levels and noise, training half); on the SD3 proxy only the transformer is sharded and trains, the text encoders and
the VAE stay whole, frozen and without gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.tensor import DTensor

from miles_diffusion.flow_grpo import FlowGRPOConfig, group_advantages
from miles_diffusion.fsdp import DataParallel, data_parallel, denoiser_blocks, mixed_precision_options
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.nft import DiffusionNFTConfig, DiffusionNFTTrainer
from miles_diffusion.objectives import ImageBatch, Rollout, TrainerConfig
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample
from miles_diffusion.sft import SFTConfig, SFTTrainer
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_fsdp.ranks import free_port

from ._step_checks import full, record_first_update

WORLD = 2
SAMPLER = SamplerConfig(num_steps=4, noise_level=0.7)
TRAINER = TrainerConfig(lr=1e-3, steps_per_update=2)
OBJECTIVE = FlowGRPOConfig(clip_range=0.2, kl_coef=0.1)
STEPS = [3, 0, 2]  # two optimizer updates: steps 3 and 0, then step 2
SD3_PROMPTS = ("a photo of a red apple", "a lighthouse at dusk")
NFT = DiffusionNFTConfig(beta=0.5, timesteps_per_iteration=3)  # two updates: draws 1-2, then draw 3
SFT = SFTConfig(updates_per_iteration=2)


def _fixed_rollout() -> tuple[Trajectory, torch.Tensor]:
    """8 trajectories (2 prompts x 4) of the seed-0 tiny UNet and their advantages, the same everywhere."""
    model = build_tiny_model(TinyFlowModelConfig(), 0)
    generator = torch.Generator().manual_seed(7)
    prompts = torch.tensor([1, 3]).repeat_interleave(4)
    trajectory = sample(model, prompts, SAMPLER, generator)
    rewards = torch.rand(prompts.shape[0], generator=generator)
    return trajectory, group_advantages(rewards, 4)


def _fixed_images() -> ImageBatch:
    """6 images (an uneven split over 2 ranks is not needed: 3 each) and their prompt ids."""
    generator = torch.Generator().manual_seed(11)
    config = TinyFlowModelConfig()
    images = torch.rand(6, config.channels, config.image_size, config.image_size, generator=generator) * 2 - 1
    return ImageBatch(images, torch.tensor([0, 1, 2, 3, 0, 1]))


def _nft_sft_steps(place: object | None = None) -> dict[str, Any]:
    """One DiffusionNFT ``train_on_rollout`` and one SFT ``train_on_batch`` of the seed-0 tiny UNet,
    one process (``place`` None) or data-parallel over the process group, in float64: in float32 the
    two orders of the batch's sums differ by up to ~4e-6 of a tensor's largest gradient entry (the
    small-gradient norm and bias tensors), in float64 by ~5e-15, so float64 shows the split exact."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _objective_steps(place)
    finally:
        torch.set_default_dtype(default)


def _objective_steps(place: object | None) -> dict[str, Any]:
    report: dict[str, Any] = {}
    trajectory, advantages = _fixed_rollout()
    rollout = Rollout(trajectory, torch.zeros(advantages.shape[0]), 4, advantages=advantages)
    trainers: dict[str, Any] = {
        "nft": DiffusionNFTTrainer(build_tiny_model(TinyFlowModelConfig(), 0), NFT, TRAINER),
        "sft": SFTTrainer(build_tiny_model(TinyFlowModelConfig(), 0), SFT, TRAINER),
    }
    for name, trainer in trainers.items():
        if place is not None:
            assert data_parallel(trainer) == place
            assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
        grads: dict[str, torch.Tensor] = {}
        record_first_update(trainer, grads)
        generator = torch.Generator().manual_seed(5)
        if name == "nft":
            stats = trainer.train_on_rollout(rollout, generator)
        else:
            stats = trainer.train_on_batch(_fixed_images(), generator)
        state = {k: full(v) for k, v in trainer.model.state_dict().items()}
        report[name] = {"state": state, "stats": stats, "grads": grads}
    return report


def _one_process_step() -> dict[str, Any]:
    trajectory, advantages = _fixed_rollout()
    trainer = FlowGRPOTrainer(
        build_tiny_model(TinyFlowModelConfig(), 0), OBJECTIVE, TRAINER, SAMPLER.noise_level
    )
    grads: dict[str, torch.Tensor] = {}
    record_first_update(trainer, grads)
    stats = trainer.train_step(trajectory, advantages, STEPS)
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"state": state, "stats": stats, "grads": grads}


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def _rank(rank: int, port: int, proxy: str, out: str) -> None:
    _init(rank, port)
    try:
        unet = _unet_step(rank)
        objectives = _nft_sft_steps(DataParallel(rank, WORLD))
        sd3 = _sd3_report(proxy)
        bf16 = _bf16_report()
        if rank == 0:
            torch.save({"unet": unet, "sd3": sd3, "bf16": bf16, **objectives}, out)
    finally:
        dist.destroy_process_group()


def _unet_step(rank: int) -> dict[str, Any]:
    trajectory, advantages = _fixed_rollout()
    model = build_tiny_model(TinyFlowModelConfig(), 0)
    trainer = FlowGRPOTrainer(model, OBJECTIVE, TRAINER, SAMPLER.noise_level)
    place = data_parallel(trainer)
    assert place == DataParallel(rank, WORLD)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert trainer.reference is not None
    assert not any(isinstance(p, DTensor) for p in trainer.reference.parameters())
    grads: dict[str, torch.Tensor] = {}
    record_first_update(trainer, grads)
    stats = trainer.train_step(trajectory, advantages, STEPS)
    state = {k: full(v) for k, v in model.state_dict().items()}
    return {"state": state, "stats": stats, "grads": grads}


def _sd3_report(proxy: str) -> dict[str, Any]:
    from miles_diffusion.families import load_model

    model = load_model(Path(proxy), prompts=SD3_PROMPTS)
    frozen = model.frozen_modules()
    before = {f"{n}.{k}": v.clone() for n, m in frozen.items() for k, v in m.state_dict().items()}
    trainer = FlowGRPOTrainer(model, FlowGRPOConfig(clip_range=0.2), TRAINER, 0.7)
    data_parallel(trainer)
    generator = torch.Generator().manual_seed(3)
    prompts = torch.tensor([0, 0, 1, 1])
    trajectory = sample(model, prompts, SamplerConfig(num_steps=2), generator)
    advantages = group_advantages(torch.rand(4, generator=generator), 2)
    stats = trainer.train_step(trajectory, advantages, [0])
    report: dict[str, Any] = {
        "transformer_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "transformer_grads": sum(p.grad is not None for p in model.parameters()),
        "frozen_sharded": any(isinstance(p, DTensor) for m in frozen.values() for p in m.parameters()),
        "frozen_trainable": any(p.requires_grad for m in frozen.values() for p in m.parameters()),
        "frozen_grads": any(p.grad is not None for m in frozen.values() for p in m.parameters()),
        "frozen_unchanged": all(
            torch.equal(before[f"{n}.{k}"], v) for n, m in frozen.items() for k, v in m.state_dict().items()
        ),
        "frozen_names": sorted(frozen),
        "loss_finite": bool(torch.isfinite(torch.tensor(stats["loss"]))),
    }
    return report


def _bf16_report() -> dict[str, Any]:
    """A BF16 ``precision`` with FP32 modules: which dtype each module's parameters are gathered in."""
    precision = PrecisionConfig(compute_dtype="bfloat16", fp32_modules=("unet.time_embedding",))
    model = build_tiny_model(TinyFlowModelConfig(), 0, precision)
    trainer = FlowGRPOTrainer(model, OBJECTIVE, TRAINER, SAMPLER.noise_level)
    data_parallel(trainer, precision)
    seen: dict[str, torch.dtype] = {}
    unet = model.unet

    def recorder(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            seen.setdefault(name, next(module.parameters()).dtype)

        return hook

    unet.time_embedding.register_forward_pre_hook(recorder("time_embedding"))
    unet.conv_in.register_forward_pre_hook(recorder("conv_in"))
    trajectory, advantages = _fixed_rollout()
    stats = trainer.train_step(trajectory, advantages, STEPS)
    return {
        "gathered": seen,
        "master": {p.dtype for p in model.parameters()},
        "finite": all(torch.isfinite(torch.tensor(v)) for v in stats.values()),
    }


def test_the_rows_split_over_the_ranks() -> None:
    assert [DataParallel(r, 3).rows(8) for r in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 8)]
    with pytest.raises(ValueError, match="does not split"):
        DataParallel(0, 2).rows(1)
    assert mixed_precision_options(PrecisionConfig()).param_dtype is None
    bf16 = mixed_precision_options(PrecisionConfig(compute_dtype="bfloat16"))
    assert (bf16.param_dtype, bf16.reduce_dtype) == ("bfloat16", "float32")
    unet = build_tiny_model(TinyFlowModelConfig(), 0).unet
    blocks = denoiser_blocks(unet)
    assert blocks == [*unet.down_blocks, *unet.up_blocks, unet.mid_block]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both checks from one spawn of two gloo ranks (rank 0's report)."""
    from miles_diffusion.train import resolve_model_dir

    proxy = resolve_model_dir("builtin:tiny-sd3")
    out = tmp_path_factory.mktemp("fsdp") / "rank0.pt"
    tmp.spawn(_rank, args=(free_port(), str(proxy), str(out)), nprocs=WORLD, join=True)
    report: dict[str, Any] = torch.load(out)
    return report


def _assert_same_step(
    got: dict[str, Any], expected: dict[str, Any], lr: float, grad_tol: float = 2e-6
) -> None:
    assert sorted(got["state"]) == sorted(expected["state"])
    # The summed gradient is the one-process gradient up to rounding (the batch's sums run in another
    # order): in float32 within 2e-6 of each tensor's largest entry.
    assert sorted(got["grads"]) == sorted(expected["grads"])
    for name, grad in expected["grads"].items():
        scale = float(grad.abs().max())
        atol = grad_tol * scale + 1e-12
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=atol, msg=name)
    # Parameters: AdamW divides each entry's gradient by its own magnitude, so an entry whose
    # gradient is near zero (a few hundred of 165k are below 1e-7) turns that rounding into a
    # visible difference of its update; bounded by 1% of one update's size (lr).
    for name, value in expected["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=0, atol=1e-2 * lr, msg=name)
    assert sorted(got["stats"]) == sorted(expected["stats"])
    for key, value in expected["stats"].items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_ranks_take_the_one_process_step(ranks: dict[str, Any]) -> None:
    _assert_same_step(ranks["unet"], _one_process_step(), TRAINER.lr)


def test_two_ranks_take_the_one_process_nft_and_sft_steps(ranks: dict[str, Any]) -> None:
    """DiffusionNFT's and SFT's steps over two ranks (each training half the rows on the whole batch's
    draws) are the one-process steps: in float64, gradients within 1e-12 of each tensor's largest
    entry, parameters and statistics within Flow-GRPO's bounds."""
    expected = _nft_sft_steps()
    for name in ("nft", "sft"):
        assert expected[name]["grads"], name
        assert all(g.dtype is torch.float64 for g in expected[name]["grads"].values())
        _assert_same_step(ranks[name], expected[name], TRAINER.lr, grad_tol=1e-12)


def test_sd3_shards_the_transformer_only(ranks: dict[str, Any]) -> None:
    report = ranks["sd3"]
    assert report["transformer_sharded"] and report["transformer_grads"] > 0
    assert report["frozen_names"] == ["text_encoder", "text_encoder_2", "vae"]
    assert not report["frozen_sharded"]
    assert not report["frozen_trainable"] and not report["frozen_grads"]
    assert report["frozen_unchanged"] and report["loss_finite"]


def test_the_driver_option_takes_every_objective() -> None:
    """fsdp_ranks trains Flow-GRPO, DiffusionNFT and SFT; sequence parallelism stays Flow-GRPO's, LoRA
    one rank's; a trainer that is not tested with it is refused by data_parallel too."""
    from miles_diffusion.recipe import recipe_from_dict

    base = {"name": "x", "evidence_level": "not verified"}
    assert recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2}}).trainer.fsdp_ranks == 2
    for name in ("diffusion_nft", "sft"):
        recipe = recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2}, "objective": {"name": name}})
        assert recipe.trainer.fsdp_ranks == 2
    sp = {"fsdp_ranks": 2, "sequence_parallel": 2}
    with pytest.raises(ValueError, match="tested with flow_grpo only"):
        recipe_from_dict({**base, "model": "builtin:tiny-wan", "trainer": sp, "objective": {"name": "sft"}})
    with pytest.raises(ValueError, match="one rank only"):
        recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2}, "lora": {"rank": 4}})
    nft = DiffusionNFTTrainer(build_tiny_model(TinyFlowModelConfig(), 0), NFT, TRAINER)
    with pytest.raises(ValueError, match="not tested with sequence_parallel 2"):
        data_parallel(nft, sequence_parallel=2)
    with pytest.raises(TypeError, match="does not train data-parallel"):
        data_parallel(object())
    with pytest.raises(ValueError, match="at least 1"):
        recipe_from_dict({**base, "trainer": {"fsdp_ranks": 0}})


@pytest.mark.extended
def test_the_driver_runs_two_ranks(tmp_path: Path) -> None:
    """``trainer.fsdp_ranks: 2`` in the package driver: the first rollout (sampled before any update,
    through the sharded model) is the one-process run's bit for bit; after that the runs agree up to
    the float32 rounding of the data-parallel gradient sums."""
    from dataclasses import replace

    from miles_diffusion.recipe import load_recipe
    from miles_diffusion.train import TIMING_PREFIX, run

    recipe = replace(load_recipe("tiny_flow_grpo"), num_iterations=3)
    one = run(recipe)
    two = run(replace(recipe, trainer=replace(recipe.trainer, fsdp_ranks=2)), tmp_path)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    for key in ("reward/mean", "reward/std", "reward/max", "log_prob/mean", "eval/reward_before"):
        assert two[0][key] == one[0][key], key
    for a, b in zip(one, two, strict=True):
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            if not key.startswith(TIMING_PREFIX) and key != "train/loss":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_bf16_gathers_the_fp32_modules_in_float32(ranks: dict[str, Any]) -> None:
    """precision: bfloat16 maps onto FSDP2's MixedPrecisionPolicy: parameters are gathered in BF16 for
    the forward, the modules named in fp32_modules in FP32; the master parameters stay FP32."""
    report = ranks["bf16"]
    assert report["gathered"] == {"time_embedding": torch.float32, "conv_in": torch.bfloat16}
    assert report["master"] == {torch.float32} and report["finite"]
