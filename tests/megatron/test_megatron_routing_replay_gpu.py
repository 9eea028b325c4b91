"""Routing replay (R3) on the megatron backend, on one CUDA GPU (scripts/gpu-tests.sh; skipped without CUDA).

A small random Qwen3-MoE in float32. With ``train.use_rollout_routing_replay`` megatron-core's
routers (through its own ``moe_enable_routing_replay`` machinery, fed by ``miles_megatron.routing``)
send every token of every MoE layer to the recorded experts, read from the routers' own routing map;
without it they do not; replaying the model's own routing changes no log-prob; the routers still
train; ``train/routing_mismatch`` is logged either way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron_helpers import make_batch, make_checkpoint

from miles.interfaces import BackendSpec
from miles.routing import ROUTING_MISMATCH
from miles.types import TrainBatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXPERTS, TOPK = 8, 2


@pytest.fixture(scope="module", params=[[], [0]], ids=["all-moe", "layer0-dense"])
def moe(request, tmp_path_factory):
    """A Qwen3-MoE checkpoint, every layer sparse or the first one dense."""
    path = make_checkpoint(
        "qwen3_moe",
        tmp_path_factory.mktemp("tiny-qwen3-moe"),
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        mlp_only_layers=request.param,
    )
    return path, 2 - len(request.param)  # (directory, sparse layers)


@pytest.fixture
def backends():
    from miles_megatron.backend import MegatronBackend

    started = []

    def start(path, replay: bool):
        backend = MegatronBackend()
        started.append(backend)
        backend.setup(
            BackendSpec(
                model_path=str(path),
                loss="sft",
                correction=None,
                transport="colocated",
                engine_urls=[],
                temperature=1.0,
                options={
                    "train": {"lr": 1e-2, "micro_batch_size": 16, "use_rollout_routing_replay": replay},
                    "megatron": {"params_dtype": "float32"},
                },
            )
        )
        return backend

    yield start
    for b in started:
        b.shutdown()


class Routes:
    """What each router did in one forward: its own top-k (from its gating, in megatron's order) and
    the experts its routing map sent each token to (after any replay)."""

    def __init__(self, trainer: Any) -> None:
        self.own: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []
        routers = trainer.routing.routers
        self._handles = [r.register_forward_pre_hook(self._pre) for r in routers]
        self._handles += [r.register_forward_hook(self._post) for r in routers]

    def _pre(self, module: Any, args: Any) -> None:
        with torch.no_grad():
            logits = module.gating(args[0]).reshape(-1, module.config.num_moe_experts)
            self.own.append(torch.topk(logits, module.topk, dim=-1).indices)

    def _post(self, module: Any, args: Any, output: Any) -> None:
        _, routing_map = output
        self.used.append(routing_map.detach())

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _forward(trainer: Any, batch: TrainBatch) -> tuple[list[list[float]], Routes]:
    """One scoring forward of the whole batch as one micro-batch, rows in sample order."""
    from miles.train_rows import sample_row

    routes = Routes(trainer)
    try:
        [out] = trainer.score([[sample_row(s) for s in batch.samples]], ["old_logprobs"])
    finally:
        routes.close()
    return [row["old_logprobs"] for row in out], routes


def _per_sample(grid: list[torch.Tensor], batch: TrainBatch) -> list[list[list[list[int]]]]:
    """Router rows (sequence first: position t of row b is t * B + b) back to each sample's positions
    0..T-2, as [position][layer][k] expert ids."""
    b = len(batch.samples)
    out = []
    for i, s in enumerate(batch.samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        out.append([[layer[t * b + i].tolist() for layer in grid] for t in range(n - 1)])
    return out


def _ids(routing_map: torch.Tensor) -> torch.Tensor:
    """``[tokens, experts]`` routing map -> ``[tokens, k]`` expert ids (ascending; k per token, no dropping)."""
    return routing_map.nonzero()[:, 1].view(routing_map.shape[0], TOPK)


def _record(batch: TrainBatch, routing: list[list[list[list[int]]]]) -> None:
    for s, rows in zip(batch.samples, routing, strict=True):
        p = len(s.prompt_ids)
        s.prompt_routed_experts, s.routed_experts = rows[: p - 1], rows[p - 1 :]
        s.check_aligned()


def _random_routing(batch: TrainBatch, layers: int, seed: int) -> list[list[list[list[int]]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            [torch.randperm(EXPERTS, generator=g)[:TOPK].tolist() for _ in range(layers)]
            for _ in range(len(s.prompt_ids) + len(s.response_ids) - 1)
        ]
        for s in batch.samples
    ]


def test_replay_sends_every_token_of_every_layer_to_the_recorded_experts(moe, backends) -> None:
    path, layers = moe
    backend = backends(path, replay=True)
    trainer = backend.trainer
    batch = make_batch(6, seed=1)
    recorded = _random_routing(batch, layers, seed=2)
    _record(batch, recorded)
    _, routes = _forward(trainer, batch)
    used = _per_sample([_ids(m) for m in routes.used], batch)
    for sample_used, sample_recorded in zip(used, recorded, strict=True):
        for got, want in zip(sample_used, sample_recorded, strict=True):
            assert [sorted(layer) for layer in got] == [sorted(layer) for layer in want]
    routers = trainer.routing.routers
    before = [r.weight.detach().clone() for r in routers]
    metrics = backend.train_step(batch)
    print("megatron replay", {k: v for k, v in metrics.items() if "routing" in k or k == "train/loss"})
    assert 0.5 < metrics[ROUTING_MISMATCH] <= 1.0  # random recorded experts: most differ from its own
    assert all(not torch.equal(r.weight, w) for r, w in zip(routers, before, strict=True))  # routers train


def test_without_replay_the_recorded_experts_are_not_used(moe, backends) -> None:
    path, layers = moe
    backend = backends(path, replay=False)
    batch = make_batch(6, seed=1)
    recorded = _random_routing(batch, layers, seed=2)
    _record(batch, recorded)
    _, routes = _forward(backend.trainer, batch)
    for own, used in zip(routes.own, routes.used, strict=True):
        assert torch.equal(_ids(used), own.sort(dim=-1).values)  # its own top-k, as without replay
    used = _per_sample([_ids(m) for m in routes.used], batch)
    same = [
        sorted(g) == sorted(w)
        for got_rows, want_rows in zip(used, recorded, strict=True)
        for got, want in zip(got_rows, want_rows, strict=True)
        for g, w in zip(got, want, strict=True)
    ]
    assert sum(same) < 0.5 * len(same)
    metrics = backend.train_step(batch)
    # The step's own forward (rows planned longest first) may flip a near-tie the scoring pass did not.
    assert metrics[ROUTING_MISMATCH] == pytest.approx(1 - sum(same) / len(same), abs=0.02)


def test_replaying_the_models_own_routing_changes_no_logprob(moe, backends) -> None:
    path, _ = moe
    free = backends(path, replay=False)
    batch = make_batch(6, seed=3)
    want, routes = _forward(free.trainer, batch)
    own = _per_sample(routes.own, batch)
    free.shutdown()
    _record(batch, own)
    replayed = backends(path, replay=True)
    got, _ = _forward(replayed.trainer, batch)
    diff = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print("megatron replay of its own routing: max |log-prob difference|", diff)
    assert diff <= 1e-6  # float32: the same experts with the same weights (bit for bit expected)
    assert replayed.train_step(batch)[ROUTING_MISMATCH] == pytest.approx(0.0, abs=0.02)
