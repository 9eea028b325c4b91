"""PPO's critic on the megatron backend's CPU trainer (``megatron.device: cpu``): a megatron GPT model
with a value head (``miles_megatron.critic``).

Its values equal those of the FSDP backend's ``ValueModel`` (an HF backbone and ``value_head``) on the
same weights in float32, on one rank and split over two tensor-parallel ranks; a critic step lowers
the value loss; a checkpoint resumes the critic and its optimizer bit for bit; ``miles run`` with
``backend: megatron`` and ``algorithm.advantage: ppo`` trains and resumes the critic; what is not
built is refused in one sentence.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from megatron_helpers import cpu_run_config, make_batch, make_checkpoint, read_rows
from safetensors.torch import load_file, save_file

from miles.errors import ComponentError, ConfigError
from miles.interfaces import BackendSpec, CriticSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow

VALUES = "values"


def _spec(path, critic=None, critic_lr=1e-2, **megatron) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        scores=[VALUES],
        critic=CriticSpec(model_path=str(critic or path), lr=critic_lr),
        options={
            "train": {"lr": 1e-3, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.1},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _with_head(src, dst, seed: int = 5):
    """A copy of the HF directory ``src`` whose weights also hold a random ``value_head`` (FSDP's names)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["value_head.weight"] = torch.randn(1, hidden, generator=g) * 0.5
    tensors["value_head.bias"] = torch.tensor([0.3])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _hf_values(path, samples) -> list[list[float]]:
    """The FSDP backend's value model of ``path`` (backbone + value_head), one sample at a time."""
    import transformers

    from miles_fsdp.models import ValueModel

    model = ValueModel(transformers.AutoModel.from_pretrained(path, dtype=torch.float32)).eval()
    tensors = load_file(str(path / "model.safetensors"))
    if "value_head.weight" in tensors:
        model.value_head.load_state_dict(
            {"weight": tensors["value_head.weight"], "bias": tensors["value_head.bias"]}
        )
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            values = model(input_ids=ids)[0]
            p = len(s.prompt_ids)
            out.append(values[p - 1 : p - 1 + len(s.response_ids)].tolist())
    return out


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _ppo_batch(backend, seed: int, returns_scale: float = 1.0):
    """A batch whose samples carry the critic's current values and fixed returns, as the driver makes it."""
    batch = make_batch(n=5, seed=seed)
    values = backend.score(batch.samples, [VALUES])[VALUES]
    for sample, row in zip(batch.samples, values, strict=True):
        sample.token_scores[VALUES] = row
    batch.returns = [
        [returns_scale * ((i + j) % 3 - 1) for j in range(len(s.response_ids))]
        for i, s in enumerate(batch.samples)
    ]
    return batch


def _critic_state(backend) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    critic = backend.trainer.critic
    params = {k: v.detach().clone() for k, v in critic.gpt.named_parameters()}
    state = [t.clone() for st in critic.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    return params, state


def test_values_equal_the_fsdp_value_model_on_one_and_two_tp_ranks(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    headed = _with_head(path, tmp_path / "critic")
    batch = make_batch(n=5, seed=11)
    want = _hf_values(headed, batch.samples)
    assert _max_diff(want, [[0.0] * len(r) for r in want]) > 0.1  # the head is not zero

    for megatron in ({}, {"num_ranks": 2, "tensor_parallel": 2}):
        backend = MegatronBackend()
        backend.setup(_spec(path, critic=headed, **megatron))
        try:
            got = backend.score(batch.samples, [VALUES, "old_logprobs"])
            assert _max_diff(got[VALUES], want) < 1e-5, megatron
        finally:
            backend.shutdown()

    # A critic directory without a head starts at zero, as FSDP's (its value_head is zero-initialised);
    # a bare backbone checkpoint (FSDP's ValueModel state dict: backbone.*, value_head.*) reads the same.
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    tensors = load_file(str(headed / "model.safetensors"))
    save_file(
        {
            (k.replace("model.", "backbone.", 1) if k.startswith("model.") else k): v
            for k, v in tensors.items()
            if k != "lm_head.weight"
        },
        str(bare / "model.safetensors"),
        metadata={"format": "pt"},
    )
    backend = MegatronBackend()
    backend.setup(_spec(path))
    try:
        zeros = backend.score(batch.samples, [VALUES])[VALUES]
        assert all(v == 0.0 for row in zeros for v in row)
        assert _hf_values(path, batch.samples) == zeros
    finally:
        backend.shutdown()
    backend = MegatronBackend()
    backend.setup(_spec(path, critic=bare))
    try:
        assert _max_diff(backend.score(batch.samples, [VALUES])[VALUES], want) < 1e-5
    finally:
        backend.shutdown()


def test_a_critic_step_lowers_the_value_loss_and_leaves_the_policy_its_own_step(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    backend = MegatronBackend()
    backend.setup(_spec(path))
    try:
        losses = []
        for _ in range(4):
            batch = _ppo_batch(backend, seed=21)
            metrics = backend.train_step(batch)
            losses.append(metrics["critic/value_loss"])
            assert metrics["critic/lr"] == 1e-2 and metrics["train/lr"] == 1e-3
            assert metrics["critic/grad_norm"] > 0 and metrics["critic/update_skipped"] == 0.0
            assert "time/train_step/critic_s" in metrics
        assert losses[-1] < losses[0], losses
        assert backend.trainer.critic.steps == 4 and backend.trainer.optimizer_steps == 4
    finally:
        backend.shutdown()


def test_a_checkpoint_resumes_the_critic_and_its_optimizer_exactly(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    first = MegatronBackend()
    first.setup(_spec(path))
    try:
        for i in range(2):
            first.train_step(_ppo_batch(first, seed=30 + i))
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = _critic_state(first)
        batch = _ppo_batch(first, seed=40)
        want = first.train_step(batch)
        after = _critic_state(first)
    finally:
        first.shutdown()
    assert {p.name for p in (tmp_path / "ckpt" / "cpu" / "rank00000").iterdir()} >= {
        "critic.safetensors",
        "critic_optimizer.pt",
    }
    assert json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())["critic"] is True

    resumed = MegatronBackend()
    resumed.setup(_spec(path))
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.trainer.critic.steps == 2
        params, state = _critic_state(resumed)
        assert all(torch.equal(params[k], v) for k, v in saved[0].items())
        assert len(state) == len(saved[1]) and all(
            torch.equal(a, b) for a, b in zip(state, saved[1], strict=True)
        )
        # The same batch (its values scored by the resumed critic: the same) gives the same step.
        assert resumed.score(batch.samples, [VALUES])[VALUES] == [
            s.token_scores[VALUES] for s in batch.samples
        ]
        got = resumed.train_step(batch)
        for key in ("critic/value_loss", "critic/grad_norm", "critic/values_mean", "train/loss"):
            assert got[key] == want[key], key
        params, state = _critic_state(resumed)
        assert all(torch.equal(params[k], v) for k, v in after[0].items())
        assert all(torch.equal(a, b) for a, b in zip(state, after[1], strict=True))
    finally:
        resumed.shutdown()

    # A checkpoint with a critic does not resume a run without one.
    plain = MegatronBackend()
    spec = _spec(path)
    spec.critic, spec.scores = None, []
    plain.setup(spec)
    try:
        with pytest.raises(ComponentError, match="written with a critic and this run has none"):
            plain.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        plain.shutdown()


def test_two_ranks_dp_or_tp_train_the_critic_as_one_rank(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")

    def step(**megatron):
        backend = MegatronBackend()
        backend.setup(_spec(path, **megatron))
        try:
            batch = _ppo_batch(backend, seed=50)
            metrics = backend.train_step(batch)
            return metrics, backend.score(batch.samples, [VALUES])[VALUES]
        finally:
            backend.shutdown()

    want, want_values = step()
    assert _max_diff(want_values, [[0.0] * len(r) for r in want_values]) > 1e-3  # the critic moved
    for layout in ({"num_ranks": 2}, {"num_ranks": 2, "tensor_parallel": 2}):
        got, values = step(**layout)
        for key in ("critic/value_loss", "critic/values_mean", "critic/returns_mean"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), (layout, key)
        assert got["critic/grad_norm"] == pytest.approx(want["critic/grad_norm"], rel=1e-5), layout
        assert _max_diff(values, want_values) < 1e-5, layout


def test_a_disk_offload_moves_the_critic_with_the_actor_and_changes_nothing(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    spill = tmp_path / "spill"
    spill.mkdir()
    backend = MegatronBackend()
    backend.setup(_spec(path, offload_to="disk", offload_dir=str(spill), offload_staging_mb=1))
    try:
        backend.train_step(_ppo_batch(backend, seed=60))
        batch = _ppo_batch(backend, seed=61)
        critic = backend.trainer.critic
        params = list(critic.gpt.parameters())
        critic_bytes = sum(p.untyped_storage().nbytes() for p in params)
        off = backend.offload()
        # Its weights (and their AdamW moments) left with the policy's: their storages are empty.
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
        assert off["offload/bytes"] > 3 * critic_bytes
        backend.onload()
        assert backend.score(batch.samples, [VALUES])[VALUES] == [
            s.token_scores[VALUES] for s in batch.samples
        ]
        got = backend.train_step(batch)
    finally:
        backend.shutdown()
    plain = MegatronBackend()
    plain.setup(_spec(path))
    try:
        plain.train_step(_ppo_batch(plain, seed=60))
        want = plain.train_step(_ppo_batch(plain, seed=61))
    finally:
        plain.shutdown()
    for key in ("critic/value_loss", "critic/grad_norm", "train/loss"):
        assert got[key] == want[key], key


def test_what_the_critic_cannot_run_is_refused_in_one_sentence(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    moe = make_checkpoint("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"a MoE critic is not built for the megatron backend yet"):
        MegatronBackend().setup(_spec(path, critic=moe))
    with pytest.raises(ConfigError, match=r"optimizer_streaming with a critic is not built yet"):
        MegatronBackend().setup(_spec(path, optimizer_streaming=True))
    spec = _spec(path)
    spec.critic = None
    with pytest.raises(ConfigError, match=r"needs values but no critic is set"):
        MegatronBackend().setup(spec)
    small = make_checkpoint("qwen3", tmp_path / "small", vocab_size=64)
    with pytest.raises(ConfigError, match=r"critic's vocabulary \(64\) is smaller than the policy's \(96\)"):
        MegatronBackend().setup(_spec(path, critic=small))


def test_miles_run_trains_a_ppo_critic_with_megatron_on_cpu_and_resumes_it(tmp_path, monkeypatch):
    import math

    from miles.loop import train

    def config(steps: int):
        ppo = ["rollout.n_samples_per_prompt=2", "algorithm.advantage=ppo", "algorithm.critic={lr: 0.01}"]
        return cpu_run_config(tmp_path, monkeypatch, steps, *ppo)

    result = train(config(3))
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["critic/value_loss"]) and r["critic/grad_norm"] > 0 for r in rows)
    assert rows[0]["critic/values_mean"] == 0.0 and rows[0]["critic/returns_mean"] > 0  # the head starts at 0
    assert rows[1]["critic/values_mean"] != 0.0  # ... and has trained since
    assert all(r["critic/lr"] == 0.01 for r in rows)
    ckpt = next(p for p in (tmp_path / "default").rglob("miles_megatron.json"))
    assert json.loads(ckpt.read_text())["critic"] is True

    result = train(config(4), resume=True)
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint
    assert math.isfinite(rows[-1]["critic/value_loss"]) and rows[-1]["critic/values_mean"] != 0.0
