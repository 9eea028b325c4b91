"""Parallel layout planning (CPU): sizes, rank coordinates, export sources, refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions
from miles_megatron.layout import ModelShape, ParallelLayout, plan_layout

DENSE = ModelShape(num_layers=28, num_heads=16, num_kv_heads=8, ffn_hidden=3072)
MOE = ModelShape(
    num_layers=48, num_heads=32, num_kv_heads=4, ffn_hidden=6144, num_experts=128, moe_ffn_hidden=768
)


def plan(world: int, **sizes: object) -> ParallelLayout:
    return plan_layout(MegatronOptions(num_ranks=world, **sizes))


def test_one_gpu_is_all_ones():
    layout = plan(1)
    assert (layout.tp, layout.pp, layout.cp, layout.ep, layout.etp, layout.dp, layout.edp) == (1,) * 7
    assert layout.megatron_kwargs() == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }
    layout.check_model(DENSE)
    layout.check_model(MOE)


def test_data_parallel_is_the_rest():
    layout = plan(16, tensor_parallel=2, pipeline_parallel=2, context_parallel=2)
    assert layout.dp == 2
    moe = plan(16, tensor_parallel=2, pipeline_parallel=2, expert_parallel=4, expert_tensor_parallel=1)
    assert (moe.dp, moe.etp, moe.ep, moe.edp) == (4, 1, 4, 2)
    assert plan(8, tensor_parallel=4).etp == 4  # ETP defaults to TP


def test_rank_coordinates_cover_the_grid_once():
    layout = plan(16, tensor_parallel=2, pipeline_parallel=2, context_parallel=2, expert_parallel=2)
    coords = [layout.coords(r) for r in range(16)]
    assert len({(c.tp, c.cp, c.dp, c.pp) for c in coords}) == 16
    assert len({(c.etp, c.ep, c.edp, c.pp) for c in coords}) == 16
    c = layout.coords(5)  # 5 = tp 1 + 2 * (cp 0) + 4 * (dp 1) + 8 * (pp 0)
    assert (c.tp, c.cp, c.dp, c.pp) == (1, 0, 1, 0)
    assert (c.etp, c.ep, c.edp) == (1, 0, 1)  # etp = tp = 2 is fastest, then ep
    assert layout.coords(8).pp == 1 and layout.stage_ranks(1) == list(range(8, 16))
    assert layout.export_sources() == [0, 8]  # one sender per pipeline stage
    with pytest.raises(ValueError):
        layout.coords(16)


@pytest.mark.parametrize(
    ("world", "sizes", "match"),
    [
        (6, dict(tensor_parallel=4), "does not divide the world of 6"),
        (8, dict(tensor_parallel=2, pipeline_parallel=2, context_parallel=4), "= 16 does not divide"),
        (4, dict(expert_parallel=8), "ETP x EP = 1 x 8 = 8 does not divide the 4 ranks"),
        (
            8,
            dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=4, pipeline_parallel=2),
            "ETP x EP",
        ),
        (2, dict(sequence_parallel=True), "sequence_parallel needs tensor_parallel > 1"),
    ],
)
def test_sizes_that_do_not_fit_the_world_are_refused(world, sizes, match):
    with pytest.raises(ConfigError, match=match):
        plan(world, **sizes)


def test_sizes_must_be_positive():
    with pytest.raises(ValidationError):
        MegatronOptions(tensor_parallel=0)
    with pytest.raises(ValidationError):
        MegatronOptions(tensor_paralel=2)  # unknown keys are refused


def test_model_shape_refusals_name_every_problem():
    with pytest.raises(ConfigError) as err:
        plan(32, tensor_parallel=16, pipeline_parallel=2).check_model(DENSE)
    text = str(err.value)
    assert "8 key/value heads do not split over TP=16" in text
    assert "16 attention heads" not in text  # 16 heads do split over TP=16
    with pytest.raises(ConfigError, match="28 layers do not split into PP=8"):
        plan(8, pipeline_parallel=8).check_model(DENSE)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        plan(2, expert_parallel=2).check_model(DENSE)
    with pytest.raises(ConfigError, match="128 experts do not split over EP=3"):
        plan(3, expert_parallel=3).check_model(MOE)
    with pytest.raises(ConfigError, match="expert FFN width 768 does not split over ETP=5"):
        plan(5, tensor_parallel=1, expert_tensor_parallel=5).check_model(MOE)
    plan(64, tensor_parallel=4, pipeline_parallel=4, expert_parallel=4).check_model(MOE)
