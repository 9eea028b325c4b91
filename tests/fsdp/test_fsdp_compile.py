"""``fsdp.compile``: decoder layers compiled in place train exactly as the eager ones."""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import make_batch, make_spec
from miles_fsdp.models import compile_layers, decoder_layers


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids).logits.float()
    loss = out.log_softmax(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_layers_equal_eager_and_keep_parameter_names(tiny_model):
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    compiled = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    names = [n for n, _ in compiled.named_parameters()]
    compile_layers(decoder_layers(compiled), "aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints and exports unchanged
    ids = torch.randint(0, 128, (2, 9))
    loss_e, grads_e = _loss_and_grads(eager, ids)
    from torch._dynamo.utils import counters

    counters.clear()
    loss_c, grads_c = _loss_and_grads(compiled, ids)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers did go through dynamo
    torch.testing.assert_close(loss_c, loss_e)
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_c[n], g, msg=n)


def test_compiled_packed_backend_trains_like_the_eager_one(tiny_model, backend_factory):
    batch = make_batch(7, seed=5)
    metrics = {}
    for compiled in (False, True):
        fsdp = {
            "max_tokens_per_gpu": 24,
            **({"compile": True, "compile_backend": "aot_eager"} if compiled else {}),
        }
        backend = backend_factory(make_spec(tiny_model, 1, temperature=0.9, fsdp=fsdp))
        metrics[compiled] = [backend.train_step(batch), backend.train_step(batch)]
        backend.shutdown()
    for eager, comp in zip(metrics[False], metrics[True], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert comp[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-6), key


def test_an_unknown_compile_backend_is_refused_with_the_known_ones():
    from pydantic import ValidationError

    from miles_fsdp.config import FSDPOptions

    with pytest.raises(ValidationError, match=r"not a torch\.compile backend; known: .*inductor"):
        FSDPOptions(compile=True, compile_backend="nope")
    with pytest.raises(ValidationError, match=r"fsdp\.compile is false"):  # a setting that would do nothing
        FSDPOptions(compile_backend="aot_eager")
