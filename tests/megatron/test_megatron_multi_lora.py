"""Multi-LoRA (``lora.adapters``) on the Megatron backend's CPU trainer (``megatron.device: cpu``, float32).

Two adapters (different ranks, targets and rates) in the same adapter-carrying linears: a step on a
batch mixing both equals, adapter by adapter, a single-form run of that adapter alone on its rows (from
the same initial factors); the weight stream carries only the adapters that stepped since the last
update; each ``final/<name>/`` export loads with peft and gives the trainer's log-probs; a checkpoint
resumes both adapters and both optimizers bit for bit; TP = 2 and DP = 2 on gloo train the same adapters
as one rank, and their checkpoints load on one rank (resharded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron_helpers import make_batch, make_checkpoint
from safetensors.torch import load_file
from test_megatron_lora import assert_close, peft_logprobs

from miles.config.schema import ADAPTER_KEY
from miles.errors import ModelError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
MATH = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"], "lr": 5e-2}
CODE = {"rank": 2, "alpha": 4.0, "target_modules": ["k_proj", "gate_proj", "up_proj"], "lr": 2e-2}
ORDER = ["math", "code", "math", "code", "code", "math"]


def spec_of(path: Path, lora: dict, tp: int = 1, lr: float = 1e-2) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=TEMPERATURE,
        options={
            "train": {"lr": lr, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.1},
            "megatron": {"device": "cpu", "params_dtype": "float32", "num_ranks": tp, "tensor_parallel": tp},
        },
        config={"lora": lora},
    )


def multi_spec(path: Path, tp: int = 1) -> BackendSpec:
    return spec_of(path, {"adapters": {"math": MATH, "code": CODE}}, tp=tp)


def mixed(step: int):
    batch = make_batch(6, seed=70 + step, step=step)
    for sample, name in zip(batch.samples, ORDER, strict=True):
        sample.metadata[ADAPTER_KEY] = name
    return batch


def only(batch, name: str):
    from miles.train_rows import sub_batch

    return sub_batch(batch, [i for i, s in enumerate(batch.samples) if s.metadata[ADAPTER_KEY] == name])


def factors(backend: MegatronBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.trainer.gpt.named_parameters() if ".lora_" in n}


def streamed(backend: MegatronBackend) -> set[str]:
    """The adapters of the next weight update's stream (drains it, as an update does)."""
    with torch.no_grad():
        return {name.split(".lora_")[1].split(".")[1] for name, _ in backend.trainer.weight_stream()}


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("multi-lora-base"), tie_word_embeddings=False)


def test_two_adapters_in_one_batch_train_as_each_alone_and_resume_exactly(base, tmp_path):
    from miles.train_rows import OLD_LOGPROBS

    multi = MegatronBackend()
    multi.setup(multi_spec(base))
    try:
        named = dict(multi.trainer.gpt.named_parameters())
        start = factors(multi)
        # One A/B pair per adapter and per targeted HF part, side by side in the same linears.
        assert {n.rsplit(".", 1)[1] for n in start} == {
            *(f"math-{p}" for p in ("q_proj", "v_proj", "o_proj", "down_proj")),
            *(f"code-{p}" for p in ("k_proj", "gate_proj", "up_proj")),
        }
        assert all(p.requires_grad == (n in start) for n, p in named.items())
        m0 = multi.train_step(mixed(0))
        for name, rate in (("math", MATH["lr"]), ("code", CODE["lr"])):
            assert m0[f"lora/{name}/stepped"] == 1.0 and m0[f"lora/{name}/train/lr"] == rate
            assert f"lora/{name}/train/grad_norm" in m0
        assert m0["train/optimizer_steps"] == 2.0
        assert m0["train/loss"] == m0["lora/math/train/loss"] + m0["lora/code/train/loss"]
        assert multi.unsent_adapters() == ["math", "code"]
        assert streamed(multi) == {"math", "code"}
        assert multi.unsent_adapters() == [] and streamed(multi) == set()
        # A batch of math's rows only: code takes no step and is not in the next update.
        code_before = {n: t for n, t in factors(multi).items() if "code-" in n}
        m1 = multi.train_step(only(mixed(1), "math"))
        assert m1["lora/math/stepped"] == 1.0 and m1["lora/code/stepped"] == 0.0
        assert "lora/code/train/loss" not in m1 and m1["train/optimizer_steps"] == 1.0
        assert all(torch.equal(named[n], t) for n, t in code_before.items())
        assert multi.unsent_adapters() == ["math"]
        multi.save_checkpoint(str(tmp_path / "ckpt"))
        multi.export_hf(str(tmp_path / "final"))
        # Each export is a peft directory with the trainer's function for that adapter's rows.
        probe = mixed(5)
        scored = multi.score(probe.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
        for name, shape in (("math", MATH), ("code", CODE)):
            config = json.loads((tmp_path / "final" / name / "adapter_config.json").read_text())
            assert config["r"] == shape["rank"] and sorted(config["target_modules"]) == sorted(
                shape["target_modules"]
            )
            rows = [i for i, s in enumerate(probe.samples) if s.metadata[ADAPTER_KEY] == name]
            want = peft_logprobs(base, tmp_path / "final" / name, [probe.samples[i] for i in rows])
            assert_close([scored[i] for i in rows], want, 1e-5)
        assert (tmp_path / "final" / "tokenizer_config.json").is_file() or not (
            base / "tokenizer_config.json"
        ).is_file()
        m2 = multi.train_step(mixed(2))  # what the resumed trainer must repeat
        after = factors(multi)
    finally:
        multi.shutdown()

    # Each adapter alone, in the single-adapter form, from the same initial factors: the same steps on
    # its rows give the same adapter, bit for bit.
    for name, shape, steps in (("math", MATH, [mixed(0), mixed(1)]), ("code", CODE, [mixed(0)])):
        lr = shape["lr"]
        single = MegatronBackend()
        single.setup(spec_of(base, {"name": name, **{k: v for k, v in shape.items() if k != "lr"}}, lr=lr))
        try:
            own = dict(single.trainer.gpt.named_parameters())
            with torch.no_grad():
                for n, p in own.items():
                    if ".lora_" in n:
                        head, part = n.rsplit(".", 1)
                        p.copy_(start[f"{head}.{name}-{part}"])
            for batch in steps:
                single.train_step(only(batch, name))
            single.export_hf(str(tmp_path / f"single-{name}"))
        finally:
            single.shutdown()
        got, want = tensors(tmp_path / f"single-{name}"), tensors(tmp_path / "final" / name)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in got), name

    # The checkpoint: every adapter's factors and each adapter's AdamW state, in per-rank files.
    rank_dir = tmp_path / "ckpt" / "cpu" / "rank00000"
    assert set(load_file(str(rank_dir / "model.safetensors"))) == set(start)
    assert sorted(p.name for p in rank_dir.glob("optimizer-*.pt")) == [
        "optimizer-code.pt",
        "optimizer-math.pt",
    ]
    marker = json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())
    assert marker["lora"]["steps"] == {"math": 2, "code": 1}

    resumed = MegatronBackend()
    resumed.setup(multi_spec(base))
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.unsent_adapters() == ["math", "code"]  # the engines hold the initial adapters
        again = resumed.train_step(mixed(2))
        for key in (
            "lora/math/train/loss",
            "lora/code/train/loss",
            "lora/math/train/lr",
            "lora/code/train/grad_norm",
        ):
            assert again[key] == m2[key], key
        got = factors(resumed)
        assert all(torch.equal(got[n], t) for n, t in after.items())
    finally:
        resumed.shutdown()

    # ... and refused with other adapters, or as the single form.
    for lora, match in [
        ({"adapters": {"math": MATH}}, "resume with the same lora adapters"),
        ({"name": "math", "rank": 4, "target_modules": ["q_proj"]}, "resume with the same lora adapters"),
    ]:
        wrong = MegatronBackend()
        wrong.setup(spec_of(base, lora))
        try:
            with pytest.raises(ModelError, match=match):
                wrong.load_checkpoint(str(tmp_path / "ckpt"))
        finally:
            wrong.shutdown()


def test_tensor_and_data_parallel_multi_lora_on_gloo_train_the_same_adapters(base, tmp_path):
    """TP = 2 and DP = 2: both adapters equal the one-rank run's after two mixed steps, and each layout's
    checkpoint loads on one rank (each factor and each adapter's AdamW state resharded), giving that
    layout's adapters exactly, and the next step from it equals that layout's own next step."""
    batches = [mixed(0), mixed(1)]
    layouts = {"tp2": {"num_ranks": 2, "tensor_parallel": 2}, "dp2": {"num_ranks": 2, "tensor_parallel": 1}}
    for layout, megatron in [*layouts.items(), ("one", {"num_ranks": 1, "tensor_parallel": 1})]:
        spec = multi_spec(base)
        spec.options["megatron"].update(megatron)
        backend = MegatronBackend()
        backend.setup(spec)
        try:
            for batch in batches:
                backend.train_step(batch)
            backend.export_hf(str(tmp_path / layout))
            if layout != "one":
                backend.save_checkpoint(str(tmp_path / f"ckpt-{layout}"))
                backend.train_step(mixed(2))
                backend.export_hf(str(tmp_path / f"{layout}-next"))
                continue
            for saved in layouts:
                backend.load_checkpoint(str(tmp_path / f"ckpt-{saved}"))
                assert backend.unsent_adapters() == ["math", "code"]
                backend.export_hf(str(tmp_path / f"resharded-{saved}"))
                # The next step from the resharded AdamW states is the layout's own next step.
                backend.train_step(mixed(2))
                backend.export_hf(str(tmp_path / f"resharded-{saved}-next"))
        finally:
            backend.shutdown()
    for name in ("math", "code"):
        one = tensors(tmp_path / "one" / name)
        for layout in layouts:
            other = tensors(tmp_path / layout / name)
            assert set(one) == set(other)
            for key in one:
                # Summation order differs between the layouts, and Adam (math's rate 5e-2) carries it into
                # A's second step (2026-12-07: at most 5.5e-6 apart with TP = 2, 2.4e-6 with DP = 2).
                assert torch.allclose(one[key], other[key], atol=2e-5), (layout, key)
            resharded = tensors(tmp_path / f"resharded-{layout}" / name)
            assert all(torch.equal(resharded[k], other[k]) for k in other), layout
            want, got = (
                tensors(tmp_path / f"{layout}-next" / name),
                tensors(tmp_path / f"resharded-{layout}-next" / name),
            )
            assert all(torch.allclose(got[k], want[k], atol=2e-5) for k in want), layout


def test_several_adapters_with_a_critic_are_refused_in_one_line(base):
    import dataclasses

    from miles.errors import ConfigError
    from miles.interfaces import CriticSpec

    spec = dataclasses.replace(multi_spec(base), critic=CriticSpec(model_path=str(base)))
    with pytest.raises(ConfigError, match=r"lora.adapters \(multi-LoRA\) with a critic") as err:
        MegatronBackend().setup(spec)
    assert "\n" not in str(err.value)
