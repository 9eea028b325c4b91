"""Routing replay (R3) on the FSDP backend: a real ``RankTrainer`` (tiny Qwen3-MoE, gloo, one rank) here.

The experts the MoE blocks run (read by a test hook on each ``Qwen3MoeExperts``, after the
replay hook on its router) are the recorded ones at every recorded position and layer with
replay on; with it off, deliberately different recorded ids are not used and the mismatch
metric says so. Replaying the model's own routing changes no log-prob (float32, bit for bit),
gradients reach the routers, and padded and packed micro-batches lay the ids out alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp.helpers import VOCAB, make_batch, make_spec
from miles.errors import ComponentError, ConfigError
from miles.routing import ROUTING_MISMATCH
from miles.types import TrainBatch

LAYERS, EXPERTS, TOPK = 2, 8, 2


def build_tiny_qwen3_moe(dest: Path, seed: int = 0, norm_topk_prob: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a sharper router than the default init: top-k choices are far from ties
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.weight.normal_(0.0, 0.5)
    model.save_pretrained(dest)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe")))


@pytest.fixture
def process_group() -> Iterator[None]:
    import torch.distributed as dist

    from miles_fsdp.ranks import free_port

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def trainer(moe_model: str, process_group: None):
    from miles.plugins import reset_plugin_state
    from miles_fsdp.rank import RankTrainer

    built: list[RankTrainer] = []

    def build(replay: bool, packed: bool = False, **fsdp: Any) -> RankTrainer:
        reset_plugin_state()
        if packed:
            fsdp["max_tokens_per_gpu"] = 64
        spec = make_spec(
            moe_model,
            train={"micro_batch_size": 3, "use_rollout_routing_replay": replay},
            fsdp=fsdp,
            temperature=1.0,
        )
        built.append(RankTrainer(spec, rank=0, world_size=1))
        return built[-1]

    yield build
    for t in built:
        t.close()
    reset_plugin_state()


def _modules(trainer: Any, name: str) -> list[torch.nn.Module]:
    return [m for m in trainer.model.modules() if name in [c.__name__ for c in type(m).__mro__]]


class ExpertsSeen:
    """What every MoE block ran: the expert indices its experts module got, per forward, per layer."""

    def __init__(self, trainer: Any) -> None:
        self.calls: list[torch.Tensor] = []
        self._handles = [
            m.register_forward_pre_hook(lambda mod, args: self.calls.append(args[1].detach().clone()))
            for m in _modules(trainer, "Qwen3MoeExperts")
        ]

    def take(self) -> torch.Tensor:
        """[positions, layers, k] of the forwards since the last take (one forward expected)."""
        assert len(self.calls) == LAYERS, len(self.calls)
        out, self.calls = torch.stack(self.calls, dim=1), []
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _max_tokens(trainer: Any) -> int | None:
    return trainer.opts.max_tokens_per_gpu


def _starts(rows: list[Any], mb: Any, packed: bool) -> list[tuple[int, Any]]:
    """Where each row's first token sits in the micro-batch's flattened positions."""
    seq_len = mb.input_ids.shape[1]
    out, offset = [], 0
    for i, r in enumerate(rows):
        out.append((offset if packed else i * seq_len, r))
        offset += r.num_tokens
    return out


def with_routing(batch: TrainBatch, routing: list[list[list[list[int]]]]) -> TrainBatch:
    for sample, rows in zip(batch.samples, routing, strict=True):
        p = len(sample.prompt_ids)
        sample.prompt_routed_experts = [[list(layer) for layer in row] for row in rows[: p - 1]]
        sample.routed_experts = [[list(layer) for layer in row] for row in rows[p - 1 :]]
        sample.check_aligned()
    return batch


def shifted(routing: list[list[list[list[int]]]]) -> list[list[list[list[int]]]]:
    """Every expert id moved to the next expert: a different set of experts at every position."""
    return [[[[(e + 1) % EXPERTS for e in layer] for layer in row] for row in rows] for rows in routing]


def score(trainer: Any, batch: TrainBatch) -> list[list[float]]:
    from miles_fsdp.batching import split_for_scoring

    [share], layout = split_for_scoring(batch.samples, 1, 3, _max_tokens(trainer))
    [result] = [trainer.score((share, ["old_logprobs"]))]
    out: list[list[float]] = [[] for _ in batch.samples]
    for indices, rows in zip(layout[0], result, strict=True):
        for i, row in zip(indices, rows, strict=True):
            out[i] = row["old_logprobs"]
    return out


def used_experts(trainer: Any, batch: TrainBatch) -> list[list[list[list[int]]]]:
    """Per sample, the experts the MoE blocks ran at positions 0..T-2 in a forward of the trainer's own
    micro-batches (replayed when the trainer replays and the samples carry routing)."""
    from miles_fsdp.batching import collate, split_for_scoring

    [share], _ = split_for_scoring(batch.samples, 1, 3, _max_tokens(trainer))
    seen = ExpertsSeen(trainer)
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
    try:
        for rows in share.micro_batches:
            mb = collate(rows, trainer.device, packed=share.packed)
            with torch.no_grad(), trainer._routed(mb):
                trainer.model(**mb.model_inputs())
            grid = seen.take()
            for start, r in _starts(rows, mb, share.packed):
                found[(tuple(r.prompt_ids), tuple(r.response_ids))] = grid[start : start + r.num_tokens - 1]
    finally:
        seen.close()
    return [found[(tuple(s.prompt_ids), tuple(s.response_ids))].tolist() for s in batch.samples]


own_routing = used_experts  # on samples that carry no routing yet: the model's own choice


def same_sets(a: list[list[int]], b: list[list[int]]) -> bool:
    return all(sorted(x) == sorted(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_runs_the_recorded_experts_at_every_position_and_layer(trainer, packed) -> None:
    t = trainer(replay=True, packed=packed)
    batch = make_batch(7, seed=11)
    want = shifted(own_routing(t, batch))
    used = used_experts(t, with_routing(batch, want))
    for got_rows, want_rows in zip(used, want, strict=True):
        assert len(got_rows) == len(want_rows)
        assert all(same_sets(g, w) for g, w in zip(got_rows, want_rows, strict=True))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_without_replay_the_recorded_experts_are_not_used_and_the_mismatch_says_so(trainer, packed) -> None:
    from miles_fsdp.batching import split_batch

    t = trainer(replay=False, packed=packed)
    batch = make_batch(7, seed=11)
    own = own_routing(t, batch)
    recorded = shifted(own)
    used = used_experts(t, with_routing(batch, recorded))
    for got_rows, own_rows, rec_rows in zip(used, own, recorded, strict=True):
        assert all(same_sets(g, o) for g, o in zip(got_rows, own_rows, strict=True))
        assert not any(same_sets([g], [r]) for g, r in zip(got_rows, rec_rows, strict=True))
    [share] = split_batch(batch, 1, 3, max_tokens=_max_tokens(t))
    assert t.train_step(share)[ROUTING_MISMATCH] == 1.0  # every recorded (token, layer) differs


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replaying_the_models_own_routing_changes_no_logprob(trainer, packed) -> None:
    from miles_fsdp.batching import split_batch

    plain = trainer(replay=False, packed=packed)
    batch = make_batch(7, seed=5)
    free = score(plain, batch)
    routing = own_routing(plain, batch)
    replayed = trainer(replay=True, packed=packed)
    with_routing(batch, routing)
    assert score(replayed, batch) == free  # float32, bit for bit
    [share] = split_batch(batch, 1, 3, max_tokens=_max_tokens(replayed))
    assert replayed.train_step(share)[ROUTING_MISMATCH] == 0.0


def test_gradients_reach_the_routers_under_replay(trainer) -> None:
    from miles_fsdp.batching import split_batch

    t = trainer(replay=True)
    batch = make_batch(6, seed=2)
    with_routing(batch, shifted(own_routing(t, batch)))
    routers = _modules(t, "Qwen3MoeTopKRouter")
    before = [r.weight.full_tensor().clone() for r in routers]
    [share] = split_batch(batch, 1, 3)
    metrics = t.train_step(share)
    after = [r.weight.full_tensor() for r in routers]
    assert metrics[ROUTING_MISMATCH] == 1.0
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_hooks_weights_are_the_routers_softmax_at_the_recorded_experts(moe_model) -> None:
    """The hook on a plain HF model: the weights it hands the experts are the router's own formula
    at the recorded experts, and the router's weight gets a gradient through them."""
    from transformers import AutoModelForCausalLM

    from miles_fsdp.routing import RouterReplay

    for norm in (True, False):
        model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
        routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
        for r in routers:
            r.norm_topk_prob = norm
        replay = RouterReplay(model, replay=True)
        seen: list[Any] = []  # registered after the replay hook: sees what it returned
        handles = [r.register_forward_hook(_append_to(seen)) for r in routers]
        recorded = torch.randint(0, EXPERTS, (9, LAYERS, 1)).repeat(1, 1, TOPK)
        recorded[..., 1] = (recorded[..., 0] + 3) % EXPERTS
        with replay.micro_batch(recorded):
            model(torch.randint(0, VOCAB, (1, 9))).logits.sum().backward()
        assert len(seen) == LAYERS
        for layer, (logits, weights, chosen) in enumerate(seen):
            assert torch.equal(chosen, recorded[:, layer])
            probs = torch.softmax(logits.detach(), dim=-1, dtype=torch.float).gather(-1, chosen)
            want = probs / probs.sum(-1, keepdim=True) if norm else probs
            assert torch.equal(weights.detach(), want)
        assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
        assert replay.take_counts()[1] == 9 * LAYERS
        replay.close()
        for h in handles:
            h.remove()


def _append_to(outputs: list[Any]) -> Any:
    return lambda module, args, output: outputs.append(output)


def test_replay_refuses_a_sample_without_full_routing(moe_model) -> None:
    from miles.train_rows import check_batch

    batch = make_batch(3, seed=1)
    with pytest.raises(ComponentError, match="carries no routed experts"):
        check_batch(batch, replay=True)
    s = batch.samples[0]
    s.routed_experts = [[[0, 1]] * LAYERS for _ in s.response_ids]
    with pytest.raises(ComponentError, match="for its response only"):
        check_batch(batch, replay=True)
    s.prompt_routed_experts = [[[0, 1]] * LAYERS for _ in s.prompt_ids[1:]]
    s.routed_experts[0] = [[-1, -1]] * LAYERS
    with pytest.raises(ComponentError, match="not recorded"):
        check_batch(TrainBatch(samples=[s], advantages=[batch.advantages[0]], step=0), replay=True)
    check_batch(batch)  # replay off: nothing is required


def test_the_backend_refuses_replay_for_a_dense_model(tiny_model, moe_model) -> None:
    from miles_fsdp.backend import FSDPBackend

    spec = make_spec(tiny_model, train={"use_rollout_routing_replay": True})
    with pytest.raises(ConfigError, match=r"is dense \(no routed experts\)"):
        FSDPBackend().setup(spec)
    compiled = make_spec(moe_model, train={"use_rollout_routing_replay": True}, fsdp={"compile": True})
    with pytest.raises(ConfigError, match=r"turn fsdp\.compile off"):
        FSDPBackend().setup(compiled)


def test_routing_grid_lays_ids_out_like_the_tokens() -> None:
    from miles.train_rows import Row
    from miles_fsdp.batching import collate

    def row(p: int, r: int, base: int) -> Row:
        n = p + r
        routing = [[[base + t, base + t + 100]] for t in range(n - 1)]  # one layer, k = 2
        return Row([1] * p, [2] * r, [1] * r, [0.0] * r, [0.0] * r, routing=routing)

    rows = [row(2, 3, 0), row(3, 1, 1000), Row([1, 1], [2], [1], [0.0], [0.0])]  # the last has none
    padded = collate(rows, "cpu")
    assert padded.routing is not None and padded.routing.shape == (3 * 5, 1, 2)
    grid = padded.routing.view(3, 5, 1, 2)
    assert grid[0, :4, 0, 0].tolist() == [0, 1, 2, 3] and grid[0, 4].tolist() == [[-1, -1]]
    assert grid[1, :3, 0, 1].tolist() == [1100, 1101, 1102] and (grid[1, 3:] == -1).all()
    assert (grid[2] == -1).all()
    packed = collate(rows, "cpu", packed=True)
    assert packed.routing is not None and packed.routing.shape == (5 + 4 + 3, 1, 2)
    flat = packed.routing[:, 0, 0].tolist()
    assert flat == [0, 1, 2, 3, -1, 1000, 1001, 1002, -1, -1, -1, -1]
