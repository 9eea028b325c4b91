"""megatron-core GPT with converted HF weights on CUDA (scripts/gpu-tests.sh; skipped without CUDA).

megatron-core 0.16's forward pass cannot run on CPU (its rotary embedding moves ``inv_freq`` to
``torch.cuda.current_device()``), so log-prob parity with the HF model is tested here.
"""

from __future__ import annotations

import socket

import pytest
import torch
from megatron_helpers import make_checkpoint

from miles_megatron.config import MegatronOptions
from miles_megatron.convert import hf_to_megatron
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import plan_layout
from miles_megatron.parallel import megatron_parallel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def parallel():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = plan_layout(MegatronOptions())
    torch.cuda.set_device(0)
    with megatron_parallel(layout, 0, "nccl", f"tcp://127.0.0.1:{port}"):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        yield layout


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("qwen3", dict(tie_word_embeddings=True)),
        ("qwen2", {}),
        ("qwen3_moe", dict(norm_topk_prob=True)),
        ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0])),
    ],
)
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-5), ("bfloat16", 0.1)])
@pytest.mark.parametrize("attention", ["sdpa", "megatron"])
def test_logprobs_equal_the_hf_model(parallel, tmp_path, family, extra, dtype, tol, attention):
    """Both core attentions of the local spec (torch's SDPA, the default; megatron-core's own)."""
    import transformers

    from miles_megatron.model_config import DTYPES, gpt_model, transformer_config

    path = make_checkpoint(family, tmp_path, **extra)
    model = HFModel.from_dir(str(path))
    torch_dtype = DTYPES[dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).cuda().eval()
    gpt = gpt_model(model, transformer_config(model, parallel, dtype), core_attention=attention).cuda().eval()
    from safetensors.torch import load_file

    result = gpt.load_state_dict(
        hf_to_megatron(model, load_file(str(path / "model.safetensors"))), strict=False
    )
    assert not result.missing_keys and not result.unexpected_keys
    gpt.to(torch_dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, model.vocab_size, (3, 17), device="cuda")
    positions = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    with torch.no_grad():
        ours = _token_logprobs(gpt(input_ids=ids, position_ids=positions, attention_mask=None), ids)
        ref = _token_logprobs(hf(input_ids=ids).logits, ids)
    assert (ours - ref).abs().max().item() <= tol
