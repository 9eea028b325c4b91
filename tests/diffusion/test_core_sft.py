"""``miles run tiny_sft``: diffusion SFT through the core's supervised loop (``mode: sft``) on the CPU.

The core's supervised stage draws the ``coloured_shapes`` source's images in its resumable order (the
source makes each sample itself: an image payload, no tokens, no tokenizer), and the diffusion backend
trains flow matching on them. The whole 40-step recipe runs through the CLI: the held-out loss falls,
every registered metric equals the committed standard ``tests/diffusion/standards/tiny_sft_core*.json``
bit for bit (wall-clock times aside), and ``--resume`` from step 30's checkpoint redoes the last ten
steps bit for bit. A chat dataset with the diffusion backend, the image source with a token backend,
and the other mismatched pairings are refused before anything starts.

Regenerate this machine's standard (only after an intended numerical change, or to gate a new
machine bit for bit; say so in the commit): ``uv run python -m tests.diffusion.test_core_sft``.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles.config import load_recipe
from miles.driver.preflight import close_components, preflight
from miles.errors import ConfigError, MilesError
from miles.loop import train
from miles.models.registry import resolve_model
from miles_diffusion.image_data import ColouredShapesSource, ImagePayload
from miles_diffusion.model import load_pretrained
from miles_diffusion.sft import evaluation_loss

from ._cli_runs import metric_rows, miles
from ._standards import assert_matches_standard, repeatable, write_standard

STANDARD = "tiny_sft_core"  # tests/diffusion/standards/tiny_sft_core*.json
STEPS = 40  # the recipe's own run.num_steps: the standard is of the whole recipe
RESUME_FROM = 30  # the recipe checkpoints every 10 steps and keeps two: 30 and 40


@dataclass(frozen=True)
class FullRun:
    args: list[str]
    run_dir: Path
    rows: list[dict[str, float]]  # read before the resume test rewrites the run
    stderr: str


def full_run_through_the_cli(output_dir: Path) -> FullRun:
    """The shipped recipe as it is; only where it writes and the console differ (no number changes)."""
    args = ["run", "tiny_sft", "--set", f"run.output_dir={output_dir}", "--set", "tracking.console=false"]
    result = miles(*args)
    run_dir = output_dir / "tiny_sft"
    return FullRun(args, run_dir, metric_rows(run_dir), result.stderr)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> FullRun:
    return full_run_through_the_cli(tmp_path_factory.mktemp("core_sft"))


@pytest.mark.slow
def test_miles_run_fits_the_images_through_the_supervised_loop(full_run: FullRun) -> None:
    assert "recipe tiny_sft: evidence level fully gated" in full_run.stderr
    rows = full_run.rows
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["sft/samples"] == 16 and r["train/images"] == 16 for r in rows)
    assert not any(k.startswith(("rollout/", "engine/", "weight_sync/")) for r in rows for k in r)
    assert not (full_run.run_dir / "engines").exists()  # no engine started
    # The held-out loss of the untrained model, measured as the backend measures it after each step.
    source = ColouredShapesSource("coloured_shapes", options={"eval_seed": 1234})
    final = load_pretrained(full_run.run_dir / "final")
    initial = evaluation_loss(load_pretrained(resolve_model("builtin:tiny-flow-unet")), source.held_out, 1234)
    heldout = [r["sft/heldout_loss"] for r in rows]
    assert heldout[-1] < 0.4 * initial and heldout[-1] < 0.5 * heldout[0], (initial, heldout)
    # The exported policy is the one measured at the last step.
    assert evaluation_loss(final, source.held_out, 1234) == heldout[-1]


@pytest.mark.slow
def test_every_metric_matches_the_committed_standard_bit_for_bit(full_run: FullRun) -> None:
    assert_matches_standard(STANDARD, full_run.rows)


@pytest.mark.slow
def test_resume_redoes_the_last_steps_exactly(full_run: FullRun) -> None:
    (full_run.run_dir / "checkpoints" / "latest").write_text(f"step_{RESUME_FROM:06d}")
    miles(*full_run.args, "--resume")
    resumed = metric_rows(full_run.run_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert repeatable(resumed[RESUME_FROM:]) == repeatable(full_run.rows[RESUME_FROM:])


def test_the_source_makes_image_samples_in_a_resumable_order() -> None:
    source = ColouredShapesSource("coloured_shapes", seed=3)
    first = source.next_prompts(5)
    state = source.state_dict()
    later = [p.index for p in source.next_prompts(7)]
    again = ColouredShapesSource("coloured_shapes", seed=3)
    again.load_state_dict(state)
    assert [p.index for p in again.next_prompts(7)] == later
    sample = source.supervised_sample(first[0])
    assert isinstance(sample.payload, ImagePayload) and sample.payload.image.shape == (3, 16, 16)
    assert sample.payload.prompt == first[0].index % 4 and not sample.response_ids and not sample.prompt_ids
    assert torch.equal(sample.payload.image, source.supervised_sample(first[0]).payload.image)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # The core's own check: the data source's sample kind against the backend's supervised_kinds.
        (
            [
                "data.source=jsonl",
                "data.path=builtin:arith_sft",
                "data.prompt_key=messages",
                "data.label_key=null",
                "data.options={}",
            ],
            "data.source 'jsonl' yields 'tokens' samples for mode: sft, but backend 'diffusion' trains 'image'",
        ),
        (
            ["backend=fsdp", "algorithm.loss=sft", "algorithm.loss_options={}"],
            "data.source 'coloured_shapes' yields 'image' samples for mode: sft, but backend 'fsdp' trains 'tokens'",
        ),
        # The package's checks (miles_configure).
        (["backend=fsdp"], "'diffusion_sft' is a diffusion objective; it needs backend: diffusion"),
        (["algorithm.loss=sft", "algorithm.loss_options={}"], "'sft' is a token loss"),
        (["sft.max_length=64"], "cannot run sft.max_length"),
        (["train.micro_batch_size=4"], "cannot run train.micro_batch_size"),
        (["data.path=images/"], "allowed: coloured_shapes"),
        (["data.options.colours=3"], "colours"),
        # The core's mode check: a supervised loss in an RL recipe.
        (["mode=rl"], "is a supervised loss, but mode 'rl'"),
    ],
)
def test_bad_pairings_are_refused_before_anything_starts(overrides: list[str], expected: str) -> None:
    with pytest.raises(MilesError, match=re.escape(expected)):
        close_components(preflight(load_recipe("tiny_sft", overrides)).components)


@pytest.mark.slow
def test_images_of_another_size_than_the_model_are_refused_before_the_first_step(tmp_path: Path) -> None:
    config = load_recipe("tiny_sft", [f"run.output_dir={tmp_path}", "data.options.image_size=8"])
    with pytest.raises(
        ConfigError, match=re.escape("images are (3, 8, 8) (channels, height, width), the model takes")
    ):
        train(config)
    assert not (tmp_path / "tiny_sft" / "metrics.jsonl").exists() or not metric_rows(tmp_path / "tiny_sft")


if __name__ == "__main__":  # regenerate the standard: uv run python -m tests.diffusion.test_core_sft
    with tempfile.TemporaryDirectory() as out:
        print(f"wrote {write_standard(STANDARD, full_run_through_the_cli(Path(out)).rows)}")
