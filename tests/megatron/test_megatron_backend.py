"""The megatron backend's checks before any GPU work (CPU): options, refusals, layer spec, offload mechanics."""

from __future__ import annotations

import pytest
import torch

from miles.config.schema import TrainSection
from miles.errors import ConfigError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend, refusals, resolve_layer_spec, validate_options
from miles_megatron.config import MegatronOptions
from miles_megatron.offload import StorageOffloader


def _spec(**kw) -> BackendSpec:
    base = dict(
        model_path="/nowhere",
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={},
    )
    base.update(kw)
    return BackendSpec(**base)


def test_options_are_the_train_and_megatron_sections():
    train, mg = validate_options({"train": {"lr": 1e-4}, "megatron": {"params_dtype": "float32"}})
    assert train.lr == 1e-4 and mg.params_dtype == "float32" and mg.layer_spec == "auto"
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['fsdp'\]"):
        validate_options({"fsdp": {}})
    with pytest.raises(ConfigError, match="megatron backend options are invalid"):
        validate_options({"megatron": {"micro_batch_tokens": 0}})


def test_what_is_not_built_yet_is_refused_one_sentence_each():
    ok = refusals(_spec(), TrainSection(), MegatronOptions(), "local")
    assert ok == []
    problems = refusals(
        _spec(scores=["ref_logprobs", "values"], placement={"launcher": "ray"}, temperature=0.0),
        TrainSection(lr_schedule="cosine"),
        MegatronOptions(num_ranks=2, micro_batch_tokens=512),
        "local",
    )
    text = " | ".join(problems)
    assert len(problems) == 5, text  # the cosine schedule and the reference scorer are built: not refused
    assert "num_ranks is 2" in text and "DP = 2" in text and "needs values but no critic is set" in text
    assert "cosine" not in text
    assert "ray" in text and "THD" in text and "temperature" in text
    assert refusals(_spec(), TrainSection(), MegatronOptions(micro_batch_tokens=512), "te") == []


def test_core_attention_is_refused_where_it_cannot_apply():
    assert refusals(_spec(), TrainSection(), MegatronOptions(core_attention="megatron"), "local") == []
    te = refusals(_spec(), TrainSection(), MegatronOptions(core_attention="sdpa"), "te")
    assert len(te) == 1 and "layer spec is te" in te[0]
    cpu = refusals(_spec(), TrainSection(), MegatronOptions(device="cpu", core_attention="megatron"), "local")
    assert len(cpu) == 1 and "cannot run with megatron.device cpu" in cpu[0]
    with pytest.raises(ConfigError, match="megatron backend options are invalid"):
        validate_options({"megatron": {"core_attention": "flash"}})


def test_layer_spec_is_local_without_transformer_engine():
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401

        has_te = True
    except ImportError:
        has_te = False
    assert resolve_layer_spec(MegatronOptions()) == ("te" if has_te else "local")
    assert resolve_layer_spec(MegatronOptions(layer_spec="local")) == "local"
    if not has_te:
        with pytest.raises(ConfigError, match="transformer-engine is not installed"):
            resolve_layer_spec(MegatronOptions(layer_spec="te"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_setup_without_cuda_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        MegatronBackend().setup(_spec())
    with pytest.raises(RuntimeError, match="not set up"):
        MegatronBackend().train_step(None)  # type: ignore[arg-type]


def test_offload_keeps_views_and_values_bit_for_bit():
    torch.manual_seed(0)
    buffer = torch.randn(64)
    grads = [buffer[:16].view(4, 4), buffer[16:]]  # views into one buffer, as megatron's grad buffers
    state = torch.randn(8, 8, dtype=torch.bfloat16)
    want = (buffer.clone(), state.clone())
    off = StorageOffloader([buffer, *grads, state, state], "cpu")
    assert len(off.storages) == 2
    moved = off.offload()
    assert moved["bytes"] == 64 * 4 + 64 * 2
    assert buffer.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    assert off.onload()["bytes"] == moved["bytes"]
    assert torch.equal(buffer, want[0]) and torch.equal(state, want[1])
    assert torch.equal(grads[0], want[0][:16].view(4, 4))
    grads[1].add_(1.0)  # still a view of the buffer
    assert torch.equal(buffer[16:], want[0][16:] + 1.0)
