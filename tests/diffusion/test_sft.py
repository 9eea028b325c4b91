from __future__ import annotations

import pytest
import torch

from miles_diffusion.datasets import PALETTE, ShapesDatasetConfig, build_shapes_dataset, class_mean_colours
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.sft import SFTConfig, SFTTrainer, evaluation_loss

from ._standards import assert_matches_standard, run_recipe, write_standard

PROXY_ITERATIONS = 12
"""The proxy of ``tiny_sft`` its committed standard records: the recipe, 12 iterations."""
PROXY_STANDARD = "tiny_sft_proxy"


@pytest.fixture(scope="module")
def proxy_run() -> list[dict[str, float]]:
    return run_recipe("tiny_sft", PROXY_ITERATIONS)


def test_the_shapes_dataset_is_reproducible_and_coloured_by_prompt() -> None:
    config = ShapesDatasetConfig(num_images=12, held_out=4, batch_size=4, seed=3)
    a = build_shapes_dataset(config, image_size=16, num_prompts=3)
    b = build_shapes_dataset(config, image_size=16, num_prompts=3)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.held_out.images, b.held_out.images)
    assert a.train.images.shape == (12, 3, 16, 16) and a.held_out.images.shape == (4, 3, 16, 16)
    assert a.train.prompts.tolist() == [0, 1, 2] * 4
    assert not torch.equal(a.train.images[:4], a.held_out.images)
    images = (a.train.images + 1.0) / 2.0  # back to [0, 1]
    for image, prompt in zip(images, a.train.prompts, strict=True):
        lit = image.sum(dim=0) > 0
        assert 0 < lit.sum() < 16 * 16  # one shape, background around it
        colour = torch.tensor(PALETTE[int(prompt)])
        assert torch.allclose(image[:, lit], colour[:, None].expand(3, int(lit.sum())))
        assert torch.equal(image[:, ~lit], torch.zeros(3, int((~lit).sum())))
    means = class_mean_colours(images, a.train.prompts, 3)
    assert means.shape == (3, 3) and means[0, 0] > means[0, 2]  # prompt 0 is red
    with pytest.raises(ValueError, match="colours for"):
        build_shapes_dataset(config, image_size=16, num_prompts=5)


def test_sft_loss_falls_over_a_few_steps() -> None:
    model = build_tiny_model(TinyFlowModelConfig(num_prompts=4), seed=0).eval()
    data = build_shapes_dataset(ShapesDatasetConfig(num_images=16, held_out=8, batch_size=16), 16, 4)
    trainer = SFTTrainer(model, SFTConfig(), TrainerConfig(lr=2e-3))
    generator = torch.Generator().manual_seed(0)
    before = evaluation_loss(model, data.held_out, seed=9)
    losses = [trainer.train_on_batch(data.batch(generator), generator)["loss"] for _ in range(6)]
    after = evaluation_loss(model, data.held_out, seed=9)
    assert after < 0.8 * before, (before, after)
    assert losses[-1] < losses[0]
    assert evaluation_loss(model, data.held_out, seed=9) == after  # the evaluation repeats exactly


@pytest.mark.slow
def test_the_sft_recipe_fits_the_images(proxy_run: list[dict[str, float]]) -> None:
    history = proxy_run
    first, last = history[0], history[-1]
    assert last["eval/loss_after"] < 0.6 * first["eval/loss_before"]
    assert last["eval/colour_error_after"] < 0.5 * first["eval/colour_error_before"]
    assert "reward/mean" not in first and "eval/reward_before" not in first  # no reward in this recipe


@pytest.mark.slow
def test_the_sft_proxy_matches_its_committed_standard(proxy_run: list[dict[str, float]]) -> None:
    assert_matches_standard(PROXY_STANDARD, proxy_run)


if __name__ == "__main__":  # regenerate the standard: uv run python -m tests.diffusion.test_sft
    torch.set_num_threads(1)
    print(f"wrote {write_standard(PROXY_STANDARD, run_recipe('tiny_sft', PROXY_ITERATIONS))}")
