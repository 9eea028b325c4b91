"""Qwen3-MoE on the paged KV path, on the CPU: the sparse block's functions against the HF block and
RoutingRecorder, and the paged engine against the DynamicCache engine (tokens, log-probs and routed
experts, greedy and seeded, chunked prefill, preemption, requests that do not ask for routing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.helpers import VOCAB, generate_in_process

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 57))]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _moe_config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[],
    )  # fmt: skip
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def _save_moe(path: Path, seed: int, **overrides: Any) -> Path:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(_moe_config(**overrides)).save_pretrained(path)
    return path


# Two layouts: every layer sparse (top-k weights not renormalised), and a dense layer between two
# sparse ones (mlp_only_layers) with renormalised top-k weights.
LAYOUTS: dict[str, dict[str, Any]] = {
    "all-sparse": {},
    "mixed": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe_dir(request: pytest.FixtureRequest, engine_tmp: Path) -> Path:
    return _save_moe(engine_tmp / f"paged-moe-{request.param}", seed=2, **LAYOUTS[request.param])


def _engine(model_dir: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    engine = EmbeddedEngine(
        EngineOptions(model_path=str(model_dir), device="cpu", dtype="float32", **options)
    )
    engine.start()
    return engine


def _paged(model_dir: Path, **options: Any) -> Any:
    return _engine(model_dir, kv_cache="paged", kv_tokens=options.pop("kv_tokens", 512), **options)


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[Any]:
    params = {"max_new_tokens": 12, "timeout": 120, "return_routed_experts": True, **params}
    return generate_in_process(engine, prompts, **params)


def _routed(req: Any) -> torch.Tensor:
    return torch.cat(req.routed) if req.routed else torch.zeros(0, dtype=torch.int32)


# ------------------------------------------------------------ the sparse block


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_functions_equal_the_hf_block_and_the_recorder(layout: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    from miles.engines.embedded.paged.moe import (
        experts_dense,
        experts_grouped,
        is_sparse,
        moe_modules,
        route,
    )
    from miles.engines.embedded.routing import RoutingRecorder

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_moe_config(**LAYOUTS[layout])).eval()
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if is_sparse(layer.mlp)] == (
        [0, 1] if layout == "all-sparse" else [0, 2]
    )
    sparse = [layer.mlp for layer in layers if is_sparse(layer.mlp)]
    # The hidden states each sparse block sees in a real forward, and what RoutingRecorder records.
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0])) for m in sparse]
    recorder = RoutingRecorder(model)
    ids = torch.randint(0, VOCAB, (1, 41))
    try:
        recorder.start()
        with torch.no_grad():
            model(ids)
        recorded = recorder.stop(1, 41)[0]  # [tokens, sparse layers, top_k]
    finally:
        for h in hooks:
            h.remove()
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        for j, (mlp, h) in enumerate(zip(sparse, seen, strict=True)):
            block = mlp(h[None])[0]
            _, hf_weights, hf_ids = mlp.gate(h)
            buf = torch.full((h.shape[0], top_k), -1, dtype=torch.long)
            # The CPU path: the block's own modules, bit for bit.
            assert torch.equal(moe_modules(mlp, h, buf), block)
            assert torch.equal(buf, hf_ids)
            assert torch.equal(buf.to(torch.int32), recorded[:, j])
            # The CUDA path's router and experts, run here on the CPU.
            buf.fill_(-1)
            weights = route(h, mlp.gate, buf)
            assert torch.equal(buf, hf_ids) and torch.equal(weights, hf_weights)
            grouped = experts_grouped(h, buf, weights, mlp.experts, torch.arange(mlp.experts.num_experts))
            torch.testing.assert_close(grouped, block, rtol=1e-5, atol=1e-6)
            for budget in (1, 1 << 30):  # one expert at a time, and all at once
                dense = experts_dense(h, buf, weights, mlp.experts, budget_bytes=budget)
                torch.testing.assert_close(dense, block, rtol=1e-5, atol=1e-6)


def test_which_moe_models_the_paged_path_takes(engine_tmp: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeForCausalLM

    from miles.engines.embedded.paged.model import unsupported_reason

    model = Qwen3MoeForCausalLM(_moe_config())
    assert unsupported_reason(model) is None
    model.model.layers[1].mlp.experts.has_bias = True  # a layout the paged path does not read
    reason = unsupported_reason(model)
    assert reason is not None and "layer 1's experts" in reason
    torch.manual_seed(0)
    mixtral = engine_tmp / "paged-mixtral"
    MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        )
    ).save_pretrained(mixtral)  # fmt: skip
    with pytest.raises(ValueError, match="MixtralForCausalLM is not one of the paged path's models"):
        _paged(mixtral)
    qwen3_moe = _save_moe(engine_tmp / "paged-moe-auto", seed=1)
    auto = _engine(qwen3_moe, kv_cache="auto")  # auto takes the paged path on CUDA only
    try:
        assert auto.server_info()["kv_cache"] == "dynamic"
    finally:
        auto.stop()


# --------------------------------------------------------------- the engines


def test_paged_moe_equals_dynamic(moe_dir: Path) -> None:
    dynamic = _engine(moe_dir, kv_cache="dynamic")
    paged = _paged(moe_dir, chunk_tokens=7, block_size=4)  # the long prompt is cut in chunks of 7
    try:
        assert paged.server_info()["kv_cache"] == "paged"
        layers = paged.recorder.num_layers
        assert paged.paged.model.num_sparse == layers
        # The third prompt does not ask for its routing; the second asks from position 5 on.
        per_prompt: list[dict[str, Any]] = [
            {},
            {"routed_experts_start_len": 5},
            {"return_routed_experts": False},
            {},
        ]
        # Greedy: the DynamicCache engine generates the same tokens, log-probs and routing.
        a = _generate(dynamic, PROMPTS, per_prompt=per_prompt, temperature=0.0)
        b = _generate(paged, PROMPTS, per_prompt=per_prompt, temperature=0.0)
        for x, y, prompt, own in zip(a, b, PROMPTS, per_prompt, strict=True):
            assert y.finish == {"type": "length", "length": 12}
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
            if own.get("return_routed_experts", True):
                consumed = len(prompt) + len(y.output_ids) - 1  # the last token is never fed
                assert y.num_routed == x.num_routed == consumed
                assert _routed(y).shape == (consumed, layers, paged.recorder.topk)
                assert _routed(y).dtype == torch.int32
                assert torch.equal(_routed(y), _routed(x))
                # The /generate answer (routed_experts_start_len applied) is the same bytes.
                mx, my = dynamic.render(x)["meta_info"], paged.render(y)["meta_info"]
                assert my["routed_experts_shape"] == mx["routed_experts_shape"]
                assert my["routed_experts"] == mx["routed_experts"]
            else:
                assert y.routed == [] and y.num_routed == 0
                assert "routed_experts" not in paged.render(y)["meta_info"]
        # A stop token (with overlapped decoding the host reads it a step late, when the next step
        # already fed it): the stop token itself is never consumed, so it has no routing.
        stop = b[0].output_ids[4]
        [x] = _generate(dynamic, PROMPTS[:1], temperature=0.0, stop_token_ids=[stop])
        [y] = _generate(paged, PROMPTS[:1], temperature=0.0, stop_token_ids=[stop])
        assert y.finish == x.finish == {"type": "stop", "matched": stop}
        assert y.output_ids == x.output_ids
        assert y.num_routed == x.num_routed == len(PROMPTS[0]) + len(y.output_ids) - 1
        assert torch.equal(_routed(y), _routed(x))
        # Seeded sampling: the two paths draw differently (the paged path's noise is a hash of the
        # seed and the position), so the DynamicCache engine scores the paged engine's sequences:
        # the same tokens must get the same log-probs and the same experts.
        sampled = _generate(paged, PROMPTS, per_prompt=per_prompt, temperature=0.8, seed=11)
        again = _generate(paged, PROMPTS, per_prompt=per_prompt, temperature=0.8, seed=11)
        scored = _generate(
            dynamic,
            [p + y.output_ids for p, y in zip(PROMPTS, sampled, strict=True)],
            per_prompt=[{"logprob_start_len": len(p) - 1} for p in PROMPTS],
            temperature=0.8,
            max_new_tokens=0,
        )
        for x, y, z, prompt, own in zip(scored, sampled, again, PROMPTS, per_prompt, strict=True):
            assert y.output_ids == z.output_ids and torch.equal(_routed(y), _routed(z))
            assert y.output_logprobs == pytest.approx(x.input_logprobs, abs=1e-5)
            if own.get("return_routed_experts", True):
                consumed = len(prompt) + len(y.output_ids) - 1
                assert y.num_routed == consumed and x.num_routed == consumed + 1  # scoring feeds the last
                assert torch.equal(_routed(y), _routed(x)[:consumed])
            else:
                assert y.routed == []
        assert paged.scheduler.stats["prefill_chunks"] > len(PROMPTS)  # the long prompt took several
    finally:
        dynamic.stop()
        paged.stop()


def test_paged_moe_preemption_keeps_routing(moe_dir: Path) -> None:
    prompts = [list(range(10 + i, 22 + i)) for i in range(6)]  # 12 tokens each, 6 at once
    roomy = _paged(moe_dir, kv_tokens=1024, block_size=4, chunk_tokens=5)
    # 64 slots: each request needs up to 12 + 24 = 36, so decodes run out of blocks and retract,
    # and retracted requests are prefilled again (prompt and outputs) in chunks of 5.
    tight = _paged(moe_dir, kv_tokens=64, block_size=4, chunk_tokens=5)
    try:
        a = _generate(roomy, prompts, max_new_tokens=24, temperature=0.9, seed=5)
        b = _generate(tight, prompts, max_new_tokens=24, temperature=0.9, seed=5)
        assert tight.scheduler.stats["retractions"] > 0
        assert roomy.scheduler.stats["retractions"] == 0
        for x, y, prompt in zip(a, b, prompts, strict=True):
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
            # Every consumed position once, in order: none duplicated by the second prefill, none lost.
            assert y.num_routed == len(prompt) + 24 - 1 == _routed(y).shape[0]
            assert torch.equal(_routed(y), _routed(x))
        alloc = tight.paged.allocator
        with tight.scheduler.step_lock:
            alloc.check()
    finally:
        roomy.stop()
        tight.stop()


def test_paged_moe_equals_a_full_forward_with_the_recorder(engine_tmp: Path) -> None:
    """The paged engine's routing is what RoutingRecorder records in one unpadded HF forward."""
    from engine.helpers import full_forward_logprobs, load_local
    from miles.engines.embedded.routing import RoutingRecorder

    path = _save_moe(engine_tmp / "paged-moe-recorder", seed=7, norm_topk_prob=True)
    paged = _paged(path, chunk_tokens=16)
    try:
        reqs = _generate(paged, PROMPTS, temperature=0.7, seed=3, max_new_tokens=8)
    finally:
        paged.stop()
    local = load_local(path)
    recorder = RoutingRecorder(local)
    for r, prompt in zip(reqs, PROMPTS, strict=True):
        fed = prompt + r.output_ids[:-1]
        recorder.start()
        with torch.no_grad():
            local(torch.tensor([fed]))
        expected = recorder.stop(1, len(fed))[0]
        assert torch.equal(_routed(r), expected)
        assert r.output_logprobs == pytest.approx(
            full_forward_logprobs(local, prompt, r.output_ids, 0.7), abs=1e-5
        )
