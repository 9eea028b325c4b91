"""The built-in tiny models: deterministic builds, real HF checkpoints that load and run."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.models.registry import count_parameters
from miles.models.tiny import build_tiny_qwen3, build_tiny_qwen3_moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("dense")
    build_tiny_qwen3(dest, seed=0)
    return dest


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("moe")
    build_tiny_qwen3_moe(dest, seed=0)
    return dest


@pytest.mark.slow
def test_same_seed_gives_byte_identical_files_across_processes(dense: Path, tmp_path: Path) -> None:
    # A second process: the tokenizer trainer's hash maps are seeded per process, so this is the real check.
    other = tmp_path / "other"
    other.mkdir()
    code = f"from pathlib import Path; from miles.models.tiny import build_tiny_qwen3; build_tiny_qwen3(Path({str(other)!r}), seed=0)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert _hashes(other) == _hashes(dense)
    assert set(_hashes(dense)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


def test_another_seed_changes_only_the_weights(dense: Path, tmp_path: Path) -> None:
    build_tiny_qwen3(tmp_path, seed=1)
    a, b = _hashes(dense), _hashes(tmp_path)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k for k in a if a[k] != b[k]} == {"model.safetensors"}


def test_tiny_qwen3_is_a_small_tied_qwen3_that_generates(dense: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense)
    tok = AutoTokenizer.from_pretrained(dense)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.tie_word_embeddings is True
    assert model.config.hidden_size == 64 and 2 <= model.config.num_hidden_layers <= 4
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 1_000_000
    assert count_parameters(dense) == n_params  # tied: one stored matrix, counted once
    assert model.config.vocab_size == len(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.eos_token_id == im_end
    assert im_end in model.generation_config.eos_token_id

    ids = tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, return_dict=True
    )
    input_ids = torch.tensor([ids["input_ids"]])
    out = model.generate(input_ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > input_ids.shape[1]


def test_tiny_moe_has_four_experts_top2_and_runs(moe: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert json.loads((moe / "config.json").read_text())["num_experts"] == 4  # readable by transformers 4 too
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    logits = model(torch.tensor([[1, 20, 21, 2]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_moe_and_dense_share_one_tokenizer(dense: Path, moe: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (dense / name).read_bytes() == (moe / name).read_bytes()
