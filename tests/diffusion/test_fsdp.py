"""FSDP2 data-parallel Flow-GRPO training (miles_diffusion.fsdp) on CPU over gloo, with two spawned ranks.

One ``train_step`` of the tiny UNet, sharded over two ranks that each re-score half of a fixed set of
trajectories on the same steps, leaves the same parameters as the one-process trainer's step on the
same trajectories; on the SD3 proxy only the transformer is sharded and trains, the text encoders and
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
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_fsdp.ranks import free_port

WORLD = 2
SAMPLER = SamplerConfig(num_steps=4, noise_level=0.7)
TRAINER = TrainerConfig(lr=1e-3, steps_per_update=2)
OBJECTIVE = FlowGRPOConfig(clip_range=0.2, kl_coef=0.1)
STEPS = [3, 0, 2]  # two optimizer updates: steps 3 and 0, then step 2
SD3_PROMPTS = ("a photo of a red apple", "a lighthouse at dusk")


def _fixed_rollout() -> tuple[Trajectory, torch.Tensor]:
    """8 trajectories (2 prompts x 4) of the seed-0 tiny UNet and their advantages, the same everywhere."""
    model = build_tiny_model(TinyFlowModelConfig(), 0)
    generator = torch.Generator().manual_seed(7)
    prompts = torch.tensor([1, 3]).repeat_interleave(4)
    trajectory = sample(model, prompts, SAMPLER, generator)
    rewards = torch.rand(prompts.shape[0], generator=generator)
    return trajectory, group_advantages(rewards, 4)


def _record_first_update(trainer: FlowGRPOTrainer, grads: dict[str, torch.Tensor]) -> None:
    """Keep the gradients the first optimizer update takes (after clipping), whole."""
    step = trainer.optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        if not grads:
            grads.update(
                {n: _full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
            )
        return step(*args, **kwargs)

    trainer.optimizer.step = recording  # type: ignore[method-assign]


def _one_process_step() -> dict[str, Any]:
    trajectory, advantages = _fixed_rollout()
    trainer = FlowGRPOTrainer(
        build_tiny_model(TinyFlowModelConfig(), 0), OBJECTIVE, TRAINER, SAMPLER.noise_level
    )
    grads: dict[str, torch.Tensor] = {}
    _record_first_update(trainer, grads)
    stats = trainer.train_step(trajectory, advantages, STEPS)
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"state": state, "stats": stats, "grads": grads}


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _rank(rank: int, port: int, proxy: str, out: str) -> None:
    _init(rank, port)
    try:
        unet = _unet_step(rank)
        sd3 = _sd3_report(proxy)
        bf16 = _bf16_report()
        if rank == 0:
            torch.save({"unet": unet, "sd3": sd3, "bf16": bf16}, out)
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
    _record_first_update(trainer, grads)
    stats = trainer.train_step(trajectory, advantages, STEPS)
    state = {k: _full(v) for k, v in model.state_dict().items()}
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


def test_two_ranks_take_the_one_process_step(ranks: dict[str, Any]) -> None:
    expected = _one_process_step()
    got = ranks["unet"]
    assert sorted(got["state"]) == sorted(expected["state"])
    # The summed gradient is the one-process gradient up to float32 rounding (the batch's sums run
    # in another order): within 2e-6 of each tensor's largest entry.
    assert sorted(got["grads"]) == sorted(expected["grads"])
    for name, grad in expected["grads"].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=2e-6 * scale + 1e-12, msg=name)
    # Parameters: AdamW divides each entry's gradient by its own magnitude, so an entry whose
    # gradient is near zero (a few hundred of 165k are below 1e-7) turns that rounding into a
    # visible difference of its update; bounded by 1% of one update's size (lr).
    for name, value in expected["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=0, atol=1e-2 * TRAINER.lr, msg=name)
    for key, value in expected["stats"].items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_sd3_shards_the_transformer_only(ranks: dict[str, Any]) -> None:
    report = ranks["sd3"]
    assert report["transformer_sharded"] and report["transformer_grads"] > 0
    assert report["frozen_names"] == ["text_encoder", "text_encoder_2", "vae"]
    assert not report["frozen_sharded"]
    assert not report["frozen_trainable"] and not report["frozen_grads"]
    assert report["frozen_unchanged"] and report["loss_finite"]


def test_the_driver_option_is_for_flow_grpo_only() -> None:
    from miles_diffusion.recipe import recipe_from_dict

    base = {"name": "x", "evidence_level": "not verified"}
    assert recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2}}).trainer.fsdp_ranks == 2
    with pytest.raises(ValueError, match="flow_grpo only"):
        recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2}, "objective": {"name": "diffusion_nft"}})
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
