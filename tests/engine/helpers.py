"""Tiny random-weight models and a running embedded engine, for the engine tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VOCAB = 128


def make_tiny_qwen3(
    path: Path,
    *,
    seed: int = 0,
    moe: bool = False,
    eos_token_id: int | None = None,
    tokenizer: bool = False,
    **config: Any,
) -> Path:
    """Save a tiny random Qwen3 (or Qwen3-MoE) model to ``path``; weights depend only on ``seed``.

    ``config`` overrides or adds config fields (e.g. sliding-window attention).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=not moe,
    )
    common.update(config)
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer:
        _save_word_tokenizer(path)
    return path


def _save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer: token i is the word ``w{i}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)


@contextlib.contextmanager
def running_engine(model_dir: Path, log_dir: Path, **options: Any) -> Iterator[str]:
    """Start one embedded engine through the real launcher; yields its URL."""
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher()
    opts = {"device": "cpu", "dtype": "float32", "torch_threads": 1, "startup_timeout_s": 120, **options}
    try:
        [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=opts)], str(log_dir))
        yield url
    finally:
        launcher.shutdown()


def load_local(model_dir: Path) -> Any:
    """The same checkpoint in this process, for recomputing what the engine reports."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()


def full_forward_logprobs(
    model: Any, prompt: list[int], output: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T) at each output token, from one unpadded forward over prompt + output."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=model.device)).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return [float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(output)]


def greedy_local(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


GREEDY_FIELDS: dict[str, Any] = dict(
    temperature=0.0,
    top_p=1.0,
    top_k=-1,
    stop_token_ids=[],
    seed=None,
    ignore_eos=True,
    return_logprob=True,
    return_routed_experts=False,
)


def greedy_request(engine: Any, prompt: list[int], *, max_new_tokens: int, **params: Any) -> Any:
    """An in-process engine request: greedy, with log-probs, no stop (``params`` override any field)."""
    return engine.make_request(
        input_ids=prompt, rid=None, **(GREEDY_FIELDS | {"max_new_tokens": max_new_tokens} | params)
    )


def generate_in_process(
    engine: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    timeout: float,
    per_prompt: list[dict[str, Any]] | None = None,
    **params: Any,
) -> list[Any]:
    """Submit every prompt to an in-process engine's scheduler at once (greedy, log-probs, no stop
    unless ``params``, or that prompt's ``per_prompt`` entry, say otherwise) and wait for all answers."""
    import threading

    done = threading.Semaphore(0)
    reqs = []
    for i, p in enumerate(prompts):
        own = per_prompt[i] if per_prompt is not None else {}
        req = greedy_request(engine, p, **({"max_new_tokens": max_new_tokens} | params | own))
        req.on_done = lambda r: done.release()
        reqs.append(req)
    for r in reqs:
        engine.scheduler.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=timeout)
    return reqs


def hf_routing(model: Any, ids: list[int]) -> Any:
    """The experts a Hugging Face Qwen3-MoE model's own routers choose at every position of ``ids``
    (one unpadded forward): int32 ``[len(ids), sparse layers, top_k]`` on the CPU."""
    import torch

    captured: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    handles = [m.register_forward_hook(lambda mod, a, out: captured.append(out[2])) for m in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(captured, dim=1).to(device="cpu", dtype=torch.int32)
