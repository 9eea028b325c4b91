"""Routing replay (R3) on the megatron backend, the parts that run on CPU.

megatron-core's MoE router moves its weights to CUDA in every forward, so the model itself is
tested on the GPU (``test_megatron_routing_replay_gpu.py``). Here: the recorded ids laid out as
megatron's routers see the tokens (sequence first), the refusals, and the pre-hook driving
megatron-core's own ``RouterReplay`` through its top-k routing function
(``topk_routing_with_score_function``, plain torch) on a CPU stand-in for ``TopKRouter``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron_helpers import make_batch, make_checkpoint
from torch import nn

from miles.errors import ComponentError, ConfigError
from miles.interfaces import BackendSpec
from miles.train_rows import Row, batch_rows, check_batch
from miles_megatron.batch import collate

pytest.importorskip("megatron.core")

EXPERTS, TOPK, HIDDEN = 8, 2, 16


def _row(p: int, r: int, base: int, layers: int = 1) -> Row:
    n = p + r
    routing = [[[base + t, base + t + 100] for _ in range(layers)] for t in range(n - 1)]
    return Row([1] * p, [2] * r, [1] * r, [0.0] * r, [0.0] * r, routing=routing)


def test_recorded_ids_are_laid_out_sequence_first_like_megatrons_hidden_states() -> None:
    rows = [_row(2, 3, 0), _row(3, 1, 1000), Row([1, 1], [2], [1], [0.0], [0.0])]  # the last has none
    mb = collate(rows)
    b, s = mb.tokens.shape
    assert mb.routing is not None and mb.routing.shape == (s * b, 1, 2)
    # Inside the model the tokens are [S, B]: row b's position t is router row t * B + b.
    for i, r in enumerate(rows):
        for t in range(s):
            got = mb.routing[t * b + i, 0].tolist()
            want = r.routing[t][0] if r.routing and t < len(r.routing) else [-1, -1]
            assert got == want, (i, t)
    packed = collate(rows, packed=True)
    assert packed.routing is not None
    assert packed.routing[:, 0, 0].tolist() == [0, 1, 2, 3, -1, 1000, 1001, 1002, -1, -1, -1, -1]
    assert collate([Row([1, 1], [2], [1], [0.0], [0.0])]).routing is None


def test_rows_carry_the_samples_whole_sequence_routing() -> None:
    batch = make_batch(2, seed=1)
    s = batch.samples[0]
    s.prompt_routed_experts = [[[0, 1]] for _ in s.prompt_ids[1:]]
    s.routed_experts = [[[2, 3]] for _ in s.response_ids]
    rows = batch_rows(batch)
    assert rows[0].routing == s.prompt_routed_experts + s.routed_experts
    assert rows[1].routing is None
    with pytest.raises(ComponentError, match=r"sample 1 .* carries no routed experts"):
        check_batch(batch, replay=True)
    check_batch(batch)


def _spec(path, **train) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={"train": {"use_rollout_routing_replay": True, **train}, "megatron": {"device": "cpu"}},
    )


def test_replay_is_refused_for_a_dense_model_and_on_cpu(tmp_path) -> None:
    from miles_megatron.backend import MegatronBackend, routing_replay_problem
    from miles_megatron.config import MegatronOptions

    dense = make_checkpoint("qwen3", tmp_path / "dense")
    moe = make_checkpoint("qwen3_moe", tmp_path / "moe")
    assert "is dense" in (routing_replay_problem(str(dense), MegatronOptions()) or "")
    assert routing_replay_problem(str(moe), MegatronOptions()) is None  # cuda, the default
    assert "needs CUDA" in (routing_replay_problem(str(moe), MegatronOptions(device="cpu")) or "")
    config = SimpleNamespace(megatron=MegatronOptions())
    assert MegatronBackend.routing_replay_problem(str(moe), config) is None
    with pytest.raises(ConfigError, match=r"use_rollout_routing_replay: model .* is dense"):
        MegatronBackend().setup(_spec(dense))


class CpuRouter(nn.Module):
    """megatron's ``TopKRouter`` as far as routing goes (gating, then its top-k routing function with
    the router's ``RouterReplay``), with a weight that stays on the CPU."""

    def __init__(self, pre_softmax: bool, replay: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN))
        self.topk = TOPK
        self.config = SimpleNamespace(num_moe_experts=EXPERTS)
        self.pre_softmax = pre_softmax
        self.router_replay = RouterReplay() if replay else None

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)

    def forward(self, x: torch.Tensor, padding_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        logits = self.gating(x).view(-1, EXPERTS)
        return topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.pre_softmax, router_replay=self.router_replay
        )


def _recorded(positions: int, layers: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(positions * layers)])
    return ids.view(positions, layers, TOPK)


@pytest.mark.parametrize("pre_softmax", [False, True], ids=["norm_topk_prob", "full-softmax"])
def test_the_pre_hook_makes_megatrons_replay_route_by_the_recorded_experts(pre_softmax) -> None:
    from miles_megatron.routing import RouterHooks

    torch.manual_seed(0)
    routers = [CpuRouter(pre_softmax, replay=True) for _ in range(2)]
    hooks = RouterHooks(list(routers), replay=True)
    seq, batch = 5, 3  # megatron's [S, B, H]
    x = torch.randn(seq, batch, HIDDEN)
    recorded = _recorded(seq * batch, 2, seed=1)
    recorded[4] = -1  # a padded position: the router's own choice
    hooks.begin(recorded)
    for layer, router in enumerate(routers):
        probs, routing_map = router(x)
        logits = router.gating(x).view(-1, EXPERTS).detach()
        own = logits.topk(TOPK, dim=-1).indices
        for pos in range(seq * batch):
            want = own[pos] if pos == 4 else recorded[pos, layer]
            assert set(routing_map[pos].nonzero().flatten().tolist()) == set(want.tolist())
            # The weights: Hugging Face's for the recorded experts (softmax over them when normalised,
            # else the full softmax gathered there).
            chosen = logits[pos, want]
            full = torch.softmax(logits[pos], dim=-1)[want]
            expected = torch.softmax(chosen, dim=-1) if not pre_softmax else full
            assert torch.allclose(probs[pos, want].detach(), expected, atol=1e-6)
        probs.sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    mismatched, total = hooks.take_counts()
    assert total == 2 * (seq * batch - 1) and mismatched > 0
    # A micro-batch without recorded routing: megatron's replay is off, the routers choose freely.
    hooks.begin(None)
    _, routing_map = routers[0](x)
    own = routers[0].gating(x).view(-1, EXPERTS).topk(TOPK, dim=-1).indices
    assert all(set(routing_map[p].nonzero().flatten().tolist()) == set(own[p].tolist()) for p in range(15))
    assert hooks.take_counts() == (0, 0)


def test_without_replay_the_hooks_only_count() -> None:
    from miles_megatron.routing import RouterHooks

    torch.manual_seed(0)
    router = CpuRouter(pre_softmax=False, replay=False)
    hooks = RouterHooks([router], replay=False)
    x = torch.randn(4, 2, HIDDEN)
    own = router.gating(x).view(-1, EXPERTS).topk(TOPK, dim=-1).indices
    recorded = own[:, None].clone()
    recorded[0, 0] = (own[0] + 1) % EXPERTS  # one position recorded differently
    hooks.begin(recorded)
    _, routing_map = router(x)
    assert all(set(routing_map[p].nonzero().flatten().tolist()) == set(own[p].tolist()) for p in range(8))
    assert hooks.take_counts() == (1, 8)
    with pytest.raises(ComponentError, match="have no RouterReplay"):
        RouterHooks([router], replay=True)


def test_the_megatron_model_built_for_replay_has_a_replaying_router_per_sparse_layer(tmp_path) -> None:
    """The real model (built on CPU, not run here): one ``TopKRouter`` per sparse
    layer in layer order, each with megatron-core's ``RouterReplay``, which the hooks accept."""
    import socket

    from miles_megatron.config import MegatronOptions
    from miles_megatron.hf_config import HFModel
    from miles_megatron.layout import plan_layout
    from miles_megatron.model_config import gpt_model, transformer_config
    from miles_megatron.parallel import megatron_parallel
    from miles_megatron.routing import REPLAY_FIELD, RouterHooks, routers_of, supports_replay

    assert supports_replay()
    path = make_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=3, mlp_only_layers=[1])
    model = HFModel.from_dir(str(path))
    layout = plan_layout(MegatronOptions())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with megatron_parallel(layout, 0, "gloo", f"tcp://127.0.0.1:{port}"):
        config = transformer_config(model, layout, "float32", cpu_init=True, **{REPLAY_FIELD: True})
        routers = routers_of(gpt_model(model, config))
        assert len(routers) == 2 and all(r.router_replay is not None for r in routers)
        assert [r.layer_number for r in routers] == [1, 3]  # layer 2 (index 1) is dense
        hooks = RouterHooks(routers, replay=True)
        assert hooks.num_layers == 2
        hooks.close()
        plain = routers_of(gpt_model(model, transformer_config(model, layout, "float32", cpu_init=True)))
        assert all(r.router_replay is None for r in plain)
