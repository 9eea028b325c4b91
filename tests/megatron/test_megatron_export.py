"""Weight slicing per rank and the export stream back to HF names (CPU), under several layouts.

Each rank's local state is cut from the full converted checkpoint (``shard_for_rank``, the load
path); the export (``iter_export``) gathers each TP / ETP group's shards and converts them back;
the ordinary pass from ``export_sources`` plus the expert pass from ``expert_export_sources``
must give every HF tensor exactly once, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import checkpoint_tensors, make_checkpoint

from miles_megatron.config import MegatronOptions
from miles_megatron.convert import hf_to_megatron
from miles_megatron.export import iter_export, local_name, shard_for_rank
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import plan_layout

LAYOUTS = {
    "one-gpu": dict(num_ranks=1),
    "tp2": dict(num_ranks=2, tensor_parallel=2),
    "pp2": dict(num_ranks=2, pipeline_parallel=2),
    "tp2-pp2-dp2": dict(num_ranks=8, tensor_parallel=2, pipeline_parallel=2),
    "ep2": dict(num_ranks=2, expert_parallel=2),
    "tp2-ep2-etp1": dict(num_ranks=4, tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1),
}
FAMILIES = {
    "qwen3": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3_moe": {},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: make_checkpoint(f, tmp_path_factory.mktemp(f), **extra) for f, extra in FAMILIES.items()}


def _export_all(model, layout, states):
    def gather_for(rank):
        c = layout.coords(rank)

        def gather(name, tensor, group):
            if group == "tp":
                members = [
                    r
                    for r in range(layout.world)
                    if (d := layout.coords(r)).pp == c.pp and d.cp == c.cp and d.dp == c.dp
                ]
                members.sort(key=lambda r: layout.coords(r).tp)
            else:
                members = [
                    r
                    for r in range(layout.world)
                    if (d := layout.coords(r)).pp == c.pp and d.ep == c.ep and d.edp == c.edp
                ]
                members.sort(key=lambda r: layout.coords(r).etp)
            return [states[r][name] for r in members]

        return gather

    out: dict[str, torch.Tensor] = {}
    for part, sources in (("ordinary", layout.export_sources()), ("experts", layout.expert_export_sources())):
        for rank in sources:
            for name, tensor in iter_export(model, layout, rank, states[rank], gather_for(rank), part=part):
                assert name not in out, f"{name} exported twice"
                out[name] = tensor
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_layout_exports_the_checkpoint_exactly(checkpoints, family, layout_name):
    sizes = LAYOUTS[layout_name]
    model = HFModel.from_dir(str(checkpoints[family]))
    if not model.is_moe and sizes.get("expert_parallel", 1) > 1:
        pytest.skip("EP needs experts")
    layout = plan_layout(MegatronOptions(**sizes))
    hf = checkpoint_tensors(checkpoints[family])
    full = hf_to_megatron(model, hf)
    states = {r: shard_for_rank(model, layout, r, full) for r in range(layout.world)}
    back = _export_all(model, layout, states)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_ranks_hold_their_stage_experts_and_shards(checkpoints):
    model = HFModel.from_dir(str(checkpoints["qwen3_moe"]))
    layout = plan_layout(MegatronOptions(num_ranks=4, pipeline_parallel=2, expert_parallel=2))
    full = hf_to_megatron(model, checkpoint_tensors(checkpoints["qwen3_moe"]))
    # rank 3: pp 1 (global layer 1 is its local layer 0), ep 1 (experts 2, 3 are its local 0, 1)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert (
        local_name(model, layout, name, pp_rank=1, ep_rank=1)
        == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    )
    assert local_name(model, layout, name, pp_rank=1, ep_rank=0) is None
    assert local_name(model, layout, name, pp_rank=0, ep_rank=1) is None
    state = shard_for_rank(model, layout, 3, full)
    assert "embedding.word_embeddings.weight" not in state and "output_layer.weight" in state
    assert torch.equal(state["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"], full[name])
    tp = plan_layout(MegatronOptions(num_ranks=2, tensor_parallel=2))
    q3 = HFModel.from_dir(str(checkpoints["qwen3"]))
    shard = shard_for_rank(q3, tp, 1, hf_to_megatron(q3, checkpoint_tensors(checkpoints["qwen3"])))
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (32, 32)  # half the 64 rows
    assert shard["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 16)
    assert layout.export_sources() == [0, 2] and layout.expert_export_sources() == [0, 1, 2, 3]
