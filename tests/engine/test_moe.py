"""Routed experts (R3) from the embedded engine on a tiny Qwen3-MoE."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import pytest
import torch

from engine.helpers import full_forward_logprobs, hf_routing, load_local, make_tiny_qwen3, running_engine
from miles.engines.client import SGLangClient
from miles.types import SamplingParams

# One engine process per module (~10 s to start on CPU).
pytestmark = pytest.mark.slow

NUM_LAYERS, TOPK, NUM_EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(engine_tmp: Path) -> Path:
    return make_tiny_qwen3(engine_tmp / "moe-seed0", seed=0, moe=True)


@pytest.fixture(scope="module")
def url(moe_dir: Path, engine_tmp: Path):
    with running_engine(moe_dir, engine_tmp / "logs-moe") as u:
        yield u


def test_routed_experts_have_the_right_shape_and_match_the_routers(url: str, moe_dir: Path) -> None:
    model = load_local(moe_dir)
    client = SGLangClient(url)
    prompts = [[1, 2, 3, 4, 5], [9, 8], [4, 4, 4, 4, 4, 4, 4]]

    async def go():
        return await asyncio.gather(
            *(
                client.generate(
                    p, SamplingParams(max_new_tokens=6, temperature=1.0, seed=i), return_routed_experts=True
                )
                for i, p in enumerate(prompts)
            )
        )

    for prompt, out in zip(prompts, asyncio.run(go()), strict=True):
        n = len(out.output_ids)
        assert out.routed_experts is not None and len(out.routed_experts) == n
        assert all(
            len(tok) == NUM_LAYERS and all(len(layer) == TOPK for layer in tok) for tok in out.routed_experts
        )
        assert all(0 <= e < NUM_EXPERTS for tok in out.routed_experts for layer in tok for e in layer)
        # Row j is the routing of the forward that produced output j: input position len(prompt) - 1 + j.
        expected = hf_routing(model, prompt + out.output_ids[:-1])[len(prompt) - 1 :]
        got = torch.tensor(out.routed_experts)
        same = [
            set(got[j, layer].tolist()) == set(expected[j, layer].tolist())
            for j in range(n)
            for layer in range(NUM_LAYERS)
        ]
        assert sum(same) >= 0.9 * len(same), "routing differs from the model's own routers"
        # The prompt's rows: every prompt position but the last (whose row is the first output's),
        # so that prompt + output rows cover every position a trainer's forward reads (R3).
        assert out.prompt_routed_experts is not None and len(out.prompt_routed_experts) == len(prompt) - 1
        want = hf_routing(model, prompt)[: len(prompt) - 1]
        same = [
            set(row[layer]) == set(want[i, layer].tolist())
            for i, row in enumerate(out.prompt_routed_experts)
            for layer in range(NUM_LAYERS)
        ]
        assert sum(same) >= 0.9 * len(same), "prompt routing differs from the model's own routers"
        assert out.output_logprobs == pytest.approx(
            full_forward_logprobs(model, prompt, out.output_ids, 1.0), abs=1e-4
        )


def test_raw_answer_covers_every_consumed_token(url: str) -> None:
    body = {
        "input_ids": [3, 1, 4, 1, 5],
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 0},
    }
    meta = httpx.post(url + "/generate", json=body, timeout=60, trust_env=False).json()["meta_info"]
    rows = 5 + 4 - 1  # SGLang's layout: prompt + output - 1 rows (the last token is never fed)
    assert meta["routed_experts_shape"] == [rows, NUM_LAYERS, TOPK]
    assert len(base64.b64decode(meta["routed_experts"])) == rows * NUM_LAYERS * TOPK * 4
    full = base64.b64decode(meta["routed_experts"])
    # routed_experts_start_len drops the first rows (SGLang's field; used to fetch only new rows).
    body["routed_experts_start_len"] = 3
    meta = httpx.post(url + "/generate", json=body, timeout=60, trust_env=False).json()["meta_info"]
    assert meta["routed_experts_shape"] == [rows - 3, NUM_LAYERS, TOPK]
    assert base64.b64decode(meta["routed_experts"]) == full[3 * NUM_LAYERS * TOPK * 4 :]
    body["routed_experts_start_len"] = 0
    info = httpx.get(url + "/get_model_info", trust_env=False).json()
    assert info["moe"] == {"num_layers": NUM_LAYERS, "topk": TOPK, "num_experts": NUM_EXPERTS}
    # Without the flag nothing is recorded or sent.
    body["return_routed_experts"] = False
    meta = httpx.post(url + "/generate", json=body, timeout=60, trust_env=False).json()["meta_info"]
    assert "routed_experts" not in meta
