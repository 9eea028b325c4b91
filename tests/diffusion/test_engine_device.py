"""The diffusion engine's device and compute dtype: what it refuses, what a reduced-precision engine
samples, and (on a GPU machine) that a CUDA engine's trajectories replay on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_diffusion.engine.__main__ import main as engine_main
from miles_diffusion.engine.server import DiffusionEngine, GenerateBody
from miles_diffusion.families import load_model
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import step_log_prob
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import unpack

TEXTS = ("a cat", "a dog", "a bird", "a fish")


def _body() -> GenerateBody:
    ids = [2, 0, 2, 3]
    return GenerateBody(
        prompts=ids, seeds=[11, 12, 13, 14], num_steps=3, noise_level=0.7, texts=[TEXTS[i] for i in ids]
    )


def test_a_device_the_engine_cannot_use_is_refused_in_one_line() -> None:
    proxy = resolve_model_dir("builtin:tiny-sd3")
    with pytest.raises(SystemExit, match=r"--device 'tpu'; allowed: cpu, cuda, cuda:N"):
        engine_main(["--model", str(proxy), "--device", "tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--device cuda, but torch sees no CUDA device here"):
            engine_main(["--model", str(proxy), "--device", "cuda"])
    with pytest.raises(SystemExit):  # argparse names the allowed dtypes
        engine_main(["--model", str(proxy), "--dtype", "float64"])


def test_a_bfloat16_engine_samples_what_a_bfloat16_trainer_rescores() -> None:
    """``--dtype bfloat16``: the forward runs under BF16 autocast (FP32 weights); a trainer with the
    same precision re-scores every step bit for bit, and the trajectory is not the FP32 engine's."""
    proxy = resolve_model_dir("builtin:tiny-sd3")
    bf16 = PrecisionConfig(compute_dtype="bfloat16")
    engine = DiffusionEngine(str(proxy), max_batch_size=8, precision=bf16)
    batch = unpack(engine.generate(_body()))
    trainer = load_model(proxy, precision=bf16, prompts=TEXTS)
    with torch.no_grad():
        for step in range(3):
            rescored = step_log_prob(trainer, batch.trajectory, step, 0.7)[0]
            assert torch.equal(rescored, batch.trajectory.log_probs[:, step]), step
    fp32 = unpack(DiffusionEngine(str(proxy), max_batch_size=8).generate(_body()))
    assert torch.equal(fp32.trajectory.latents[:, 0], batch.trajectory.latents[:, 0])  # same seeds
    assert not torch.equal(fp32.trajectory.latents[:, -1], batch.trajectory.latents[:, -1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_draws_the_cpu_noise_and_its_steps_rescore_on_the_cpu(tmp_path: Path) -> None:
    """Noise comes from CPU generators on any device, so the starting latents equal the CPU engine's
    bit for bit; the FP32 CUDA forward differs from the CPU's only by rounding, so the CPU trainer's
    re-scored log-probs of the CUDA engine's steps agree closely; results arrive in host memory."""
    proxy = resolve_model_dir("builtin:tiny-sd3")
    cuda = unpack(DiffusionEngine(str(proxy), device="cuda", max_batch_size=8).generate(_body()))
    cpu = unpack(DiffusionEngine(str(proxy), max_batch_size=8).generate(_body()))
    assert cuda.trajectory.latents.device.type == "cpu" and cuda.images is not None
    assert torch.equal(cuda.trajectory.latents[:, 0], cpu.trajectory.latents[:, 0])
    trainer = load_model(proxy, prompts=TEXTS)
    with torch.no_grad():
        for step in range(3):
            rescored = step_log_prob(trainer, cuda.trajectory, step, 0.7)[0]
            assert torch.allclose(rescored, cuda.trajectory.log_probs[:, step], atol=1e-3, rtol=0), step
