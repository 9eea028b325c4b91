"""The GPU live-check script, run end to end against the embedded engine on CPU.

The model is a one-layer Qwen3 with the real Qwen3 vocabulary whose weights are set so that it
always answers with ``<|im_end|>`` at once (an empty reply): the conversation then runs through
every turn of the script, with real engine calls, parsing and suffixes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _always_stops(path: Path, tokenizer: Any, stop_id: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the embedding alone...
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0  # ...whose first dimension is positive,
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[stop_id, 0] = 100.0  # so the stop token wins by far
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_live_check_against_the_embedded_engine(
    tmp_path: Path, tokenizer_of: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.helpers import running_engine

    from miles_envs.families import get_family

    tokenizer = tokenizer_of("qwen3")
    stop_id = get_family("qwen3").stop_token_ids(tokenizer)[0]
    model = _always_stops(tmp_path / "model", tokenizer, stop_id)
    # The script runs in this process (it is a plain module with main(argv)): no second import of transformers.
    spec = importlib.util.spec_from_file_location(
        "family_live_check", ROOT / "scripts" / "family-live-check.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with running_engine(model, tmp_path / "logs") as url:
        args = ["--family", "qwen3", "--engine-url", url, "--thinking", "off", "--temperature", "0", "--json"]
        code = script.main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    turns = json.loads(out)
    assert [t["turn"] for t in turns] == [0, 1, 2, 3]  # one per scripted user question
    for turn in turns:
        assert (turn["finish"], turn["output_tokens"], turn["stop"], turn["parse"], turn["reply"]) == (
            "stop",
            1,
            True,
            True,
            True,
        )
    assert all(turn["boundary"] for turn in turns[:-1])  # the last turn appends nothing
