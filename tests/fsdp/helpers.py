"""Helpers shared by the FSDP and transport tests: a tiny random Qwen3 on disk, batches, backend specs."""

from __future__ import annotations

import glob
import os
import random
from pathlib import Path

import torch

VOCAB = 128


def build_tiny_qwen3(dest: Path, seed: int = 0, tie_word_embeddings: bool = False, **overrides) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tie_word_embeddings,
    }
    config = Qwen3Config(**{**shape, **overrides})
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(dest)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(dest)
    return dest


def make_batch(n: int = 5, seed: int = 0, step: int = 0, positive: bool = False):
    from miles.types import Prompt, Sample, TrainBatch

    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(n):
        p = rng.randint(2, 6)
        r = rng.randint(1, 7)
        mask = [1] * r
        if r > 2:
            mask[rng.randrange(r)] = 0  # a masked token in the middle
        samples.append(
            Sample(
                prompt=Prompt(index=i, prompt=f"p{i}"),
                prompt_ids=[rng.randrange(VOCAB) for _ in range(p)],
                response_ids=[rng.randrange(VOCAB) for _ in range(r)],
                # Encodes (sample, token) so a dumped tensor row can be traced back to its sample.
                rollout_logprobs=[-(i * 100 + j + 1) / 1000.0 for j in range(r)],
                loss_mask=mask,
                weight_versions=[0] * r,
            )
        )
        advantages.append([1.0 if positive else rng.choice([-1.0, 0.5, 1.0])] * r)
    return TrainBatch(samples=samples, advantages=advantages, step=step)


def make_spec(
    model_path: str,
    num_ranks: int = 1,
    *,
    loss: str = "fsdp.components:PGLoss",
    loss_options=None,
    correction: str | None = None,
    temperature: float = 0.8,
    train=None,
    fsdp=None,
    **kw,
):
    from miles.interfaces import BackendSpec

    train_opts = {"lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0, "eps": 1e-8}
    train_opts.update(train or {})
    fsdp_opts = {
        "num_ranks": num_ranks,
        "torch_threads": 1,
        "startup_timeout_s": 120,
        "command_timeout_s": 120,
        # Ranks fork from a server that imported torch and transformers once: seconds saved per start.
        "start_method": "forkserver",
    }
    fsdp_opts.update(fsdp or {})
    return BackendSpec(
        model_path=model_path,
        loss=loss,
        correction=correction,
        transport=kw.pop("transport", "broadcast"),
        engine_urls=kw.pop("engine_urls", []),
        temperature=temperature,
        options={"train": train_opts, "fsdp": fsdp_opts},
        loss_options=loss_options or {},
        **kw,
    )


def weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def hf_token_logprobs(model_path: str, batch, temperature: float) -> list[list[float]]:
    """The reference: a plain single-process HF forward of each sample, unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in batch.samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids).logits[0]
            lp = torch.log_softmax(logits / temperature, dim=-1)
            p = len(s.prompt_ids)
            out.append([float(lp[p + j - 1, t]) for j, t in enumerate(s.response_ids)])
    return out


def dumped_logprobs(dump_dir: str) -> dict[int, list[float]]:
    """Rows of the dumped loss inputs, keyed by sample index (decoded from rollout_logprobs)."""
    found: dict[int, list[float]] = {}
    for f in glob.glob(os.path.join(dump_dir, "*.pt")):
        d = torch.load(f)
        for lp_row, tag_row in zip(d["logprobs"], d["rollout_logprobs"], strict=True):
            # make_batch tags rollout_logprobs[i][j] = -(i*100 + j + 1)/1000; padding is 0.
            i = (round(-float(tag_row[0]) * 1000) - 1) // 100
            n = int((tag_row != 0).sum())
            found[i] = lp_row[:n].tolist()
        assert torch.equal(d["logprobs"], d["old_logprobs"])
    return found
