"""Ulysses sequence parallelism (miles_diffusion.sequence_parallel) on CPU over gloo: four spawned ranks
in two groups of two (data-parallel 2 x sequence-parallel 2) take one Flow-GRPO ``train_step`` of the
Wan proxy, and it is the one-process step: the same gradients and statistics within
float32 rounding. Each rank's transformer blocks see half of the video tokens (the split is real), and
the families without a split, or sizes that do not divide, are refused from the directory alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from miles_diffusion.flow_grpo import FlowGRPOConfig, group_advantages
from miles_diffusion.fsdp import data_parallel
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample
from miles_diffusion.sequence_parallel import SequenceSplit, check_sequence_parallel
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_fsdp.ranks import free_port

from ._step_checks import record_first_update

pytestmark = pytest.mark.slow

WORLD, DEGREE = 4, 2
TRAINER = TrainerConfig(lr=1e-3, steps_per_update=2)
OBJECTIVE = FlowGRPOConfig(clip_range=0.2)
PROMPTS = ("a red apple", "a boat at dusk")
STEPS = [1, 0]
# a block after the first: the first splits its input inside its own forward (after pre-hooks)
FIRST_BLOCK = {"tiny-wan": "blocks.1"}


def _proxy(name: str) -> Path:
    from miles_diffusion.train import resolve_model_dir

    return Path(resolve_model_dir(f"builtin:{name}"))


def _trainer(proxy: Path) -> FlowGRPOTrainer:
    from miles_diffusion.families import load_model

    torch.manual_seed(0)
    model = load_model(proxy, prompts=PROMPTS)
    return FlowGRPOTrainer(model, OBJECTIVE, TRAINER, 0.7)


def _rollout(trainer: FlowGRPOTrainer) -> tuple[Trajectory, torch.Tensor]:
    """4 trajectories (2 prompts x 2) from the untrained model, the same on every rank."""
    generator = torch.Generator().manual_seed(3)
    trajectory = sample(trainer.model, torch.tensor([0, 0, 1, 1]), SamplerConfig(num_steps=2), generator)
    return trajectory, group_advantages(torch.rand(4, generator=generator), 2)


def _count_tokens(trainer: FlowGRPOTrainer, name: str) -> list[int]:
    """The token count of every call of the family's block after the first (appended as they come)."""
    seen: list[int] = []

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append(int(hidden.shape[1]))

    trainer.model.transformer.get_submodule(FIRST_BLOCK[name]).register_forward_pre_hook(
        hook, with_kwargs=True
    )
    return seen


def _step(trainer: FlowGRPOTrainer, tokens: list[int] | None = None) -> dict[str, Any]:
    trajectory, advantages = _rollout(trainer)
    grads: dict[str, torch.Tensor] = {}
    record_first_update(trainer, grads)
    stats = trainer.train_step(trajectory, advantages, STEPS)
    return {"grads": grads, "stats": stats, "tokens": tokens}


def _rank(rank: int, port: int, proxies: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        report: dict[str, Any] = {}
        for name, proxy in proxies.items():
            trainer = _trainer(Path(proxy))
            place = data_parallel(trainer, sequence_parallel=DEGREE)
            tokens = _count_tokens(trainer, name)
            report[name] = _step(trainer, tokens) | {"place": (place.rank, place.world_size)}
        torch.save(report, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    proxies = {name: str(_proxy(name)) for name in FIRST_BLOCK}
    out = tmp_path_factory.mktemp("sp") / "rank"
    tmp.spawn(_rank, args=(free_port(), proxies, str(out)), nprocs=WORLD, join=True)
    return {r: torch.load(f"{out}.{r}") for r in range(WORLD)}


@pytest.mark.parametrize("name", sorted(FIRST_BLOCK))
def test_two_groups_of_two_take_the_one_process_step(ranks: dict[int, dict[str, Any]], name: str) -> None:
    trainer = _trainer(_proxy(name))
    whole = _count_tokens(trainer, name)
    expected = _step(trainer)
    got = ranks[0][name]
    # neighbours share rows: ranks 0, 1 are data-parallel place 0 of 2; ranks 2, 3 place 1
    assert [ranks[r][name]["place"] for r in range(WORLD)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # every forward of a sequence-parallel rank ran its blocks on half the tokens
    assert got["tokens"] and {2 * n for n in got["tokens"]} == {whole[-1]}
    assert sorted(got["grads"]) == sorted(expected["grads"])
    # float32 rounding of sums over another split of the tokens: within 1e-5 of the largest gradient
    # entry (seen: 2.2e-6 of it at most)
    scale = max(float(grad.abs().max()) for grad in expected["grads"].values())
    for key, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, rtol=0, atol=1e-5 * scale, msg=key)
    for key, value in expected["stats"].items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_the_split_is_judged_from_the_directory() -> None:
    wan = _proxy("tiny-wan")
    check_sequence_parallel(wan, 1)
    check_sequence_parallel(wan, 2)  # 12 video tokens, 2 heads
    with pytest.raises(
        ValueError, match=r"^sequence_parallel 3: .*2 attention heads do not split evenly over 3"
    ):
        check_sequence_parallel(wan, 3)
    for other in ("tiny-sd3", "tiny-ltx"):
        with pytest.raises(ValueError, match=r"family has no sequence-parallel split \(supported: wan\)"):
            check_sequence_parallel(_proxy(other), 2)
    split = SequenceSplit({"video tokens": 12, "text tokens": 7}, heads=4)
    assert split.error(2) == "7 text tokens do not split evenly over 2 ranks"
    assert split.error(4) == "7 text tokens do not split evenly over 4 ranks"
    assert SequenceSplit({"video tokens": 12}, heads=4).error(4) is None


def test_the_driver_recipe_refuses_what_cannot_split() -> None:
    from miles_diffusion.recipe import recipe_from_dict

    base = {"name": "x", "evidence_level": "not verified"}
    with pytest.raises(
        ValueError, match=r"sequence_parallel 3 must be at least 1 and divide trainer\.fsdp_ranks 2"
    ):
        recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2, "sequence_parallel": 3}})
    with pytest.raises(ValueError, match="the tiny UNet has no token sequence to split"):
        recipe_from_dict({**base, "trainer": {"fsdp_ranks": 2, "sequence_parallel": 2}})
