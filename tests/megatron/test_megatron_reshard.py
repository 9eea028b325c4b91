"""CPU checkpoints (``megatron.device: cpu``) saved under one parallel layout and loaded under another
(``miles_megatron.reshard``): tensor parallelism 2 <-> 1 and a data-parallel change, float32, gloo.

The saved state is rebuilt exactly (a TP = 2 checkpoint loaded on one rank, saved again and loaded on
TP = 2 gives the first checkpoint's files back bit for bit, so the next step equals the uninterrupted
run's bit for bit); and it computes what it computed: the next step's loss, gradient norm and updated
weights on one rank (and on DP = 2) equal the TP = 2 run's within float noise (1e-5: one rank sums
the attention and MLP products in another order than two TP shards plus gloo's all-reduce do, so
the last bits differ; the same tolerance the TP = 2 == TP = 1 test uses). A wrong fused-QKV or
gate/up reshard would change the loss at 1e-2 (the first test cuts the fused tensors by hand as
megatron's layers split them).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from megatron_helpers import SHAPE, make_batch, make_checkpoint
from safetensors.torch import load_file

from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow


def _spec(path, **megatron):
    from miles.interfaces import BackendSpec

    return BackendSpec(
        model_path=str(path),
        loss="sft",  # a loss whose value is the model's (PPO's clip loss is -advantage at ratio 1)
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.01},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _rank_files(ckpt, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    d = ckpt / "cpu" / f"rank{rank:05d}"
    return load_file(str(d / "model.safetensors")), torch.load(d / "optimizer.pt", weights_only=True)


def _same_files(a, b, rank_a: int, rank_b: int) -> None:
    (wa, oa), (wb, ob) = _rank_files(a, rank_a), _rank_files(b, rank_b)
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["param_groups"] == ob["param_groups"] and set(oa["state"]) == set(ob["state"])
    for i, st in oa["state"].items():
        assert set(st) == set(ob["state"][i])
        assert all(torch.equal(v, ob["state"][i][k]) for k, v in st.items()), i


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_the_fused_shards_are_the_layers_own():
    """``tp_shard`` / ``tp_unshard`` (what resharding joins and cuts with) against megatron's layout built
    per rank from its own heads: TP rank r of linear_qkv holds query groups [r*g/tp, (r+1)*g/tp), each as
    its query heads then its k then its v; of linear_fc1 its gate rows then its up rows."""
    from miles_megatron.convert import fuse_qkv, tp_shard, tp_unshard

    g = torch.Generator().manual_seed(0)
    heads, groups, d, hidden, tp = 8, 4, 2, 16, 2

    class Shape:  # what fuse_qkv reads
        def __init__(self, heads: int, groups: int) -> None:
            self.num_heads, self.num_kv_heads, self.head_dim = heads, groups, d

    q, k, v = (torch.randn(n * d, hidden, generator=g) for n in (heads, groups, groups))
    full = fuse_qkv(Shape(heads, groups), q, k, v)  # type: ignore[arg-type]
    per_q, per_kv = heads // tp * d, groups // tp * d
    shards = []
    for r in range(tp):
        own = fuse_qkv(
            Shape(heads // tp, groups // tp),  # type: ignore[arg-type]
            q[r * per_q : (r + 1) * per_q],
            k[r * per_kv : (r + 1) * per_kv],
            v[r * per_kv : (r + 1) * per_kv],
        )
        assert torch.equal(tp_shard("decoder.layers.0.self_attention.linear_qkv.weight", full, tp, r), own)
        shards.append(own)
    assert torch.equal(tp_unshard("decoder.layers.0.self_attention.linear_qkv.weight", shards), full)
    gate, up = torch.randn(12, hidden, generator=g), torch.randn(12, hidden, generator=g)
    fc1 = torch.cat([gate, up])
    parts = [torch.cat([gate[6 * r : 6 * (r + 1)], up[6 * r : 6 * (r + 1)]]) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, tp, r), parts[r])
    assert torch.equal(tp_unshard("decoder.layers.0.mlp.linear_fc1.weight", parts), fc1)


def test_tp2_checkpoint_resumes_on_one_rank_dp2_and_back_on_tp2(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(n=5, seed=70 + i) for i in range(3)]

    def run(name, load=None, steps=(2,), save_first=None, **megatron):
        """A backend on ``megatron``'s layout: trains ``batches[i]`` for i in ``steps`` after loading
        ``load`` (or training batches 0 and 1 and saving them to ``save_first``); its metrics, the
        log-probs after, its export."""
        backend = MegatronBackend()
        backend.setup(_spec(path, **megatron))
        try:
            if load is not None:
                backend.load_checkpoint(str(load))
            else:
                for b in batches[:2]:
                    backend.train_step(b)
            if save_first is not None:
                backend.save_checkpoint(str(save_first))
            before = backend.score(batches[2].samples, ["old_logprobs"])["old_logprobs"]
            metrics = [backend.train_step(batches[i]) for i in steps]
            after = backend.score(batches[2].samples, ["old_logprobs"])["old_logprobs"]
            backend.export_hf(str(tmp_path / name))
            return metrics[-1], after, load_file(str(tmp_path / name / "model.safetensors")), before
        finally:
            backend.shutdown()

    tp2 = dict(num_ranks=2, tensor_parallel=2)
    want = run("tp2", save_first=tmp_path / "ckpt_tp2", **tp2)
    # TP = 2 -> one rank: the rank joins both TP shards of every weight and Adam moment.
    one = run("one", load=tmp_path / "ckpt_tp2", save_first=tmp_path / "ckpt_one")
    # TP = 2 -> DP = 2 (two ranks of TP = 1): each joins them; the DP replicas are equal.
    dp2 = run("dp2", load=tmp_path / "ckpt_tp2", save_first=tmp_path / "ckpt_dp2", num_ranks=2)
    # One rank -> TP = 2: the first checkpoint's files come back bit for bit, so the step is the first run's.
    back = run("back", load=tmp_path / "ckpt_one", save_first=tmp_path / "ckpt_back", **tp2)

    marker = json.loads((tmp_path / "ckpt_one" / "miles_megatron.json").read_text())
    assert (marker["world"], marker["optimizer_steps"]) == (1, 2)
    for got in (one, dp2):
        assert got[0]["train/loss"] == pytest.approx(want[0]["train/loss"], abs=1e-5)
        assert got[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=1e-5)
        assert _max_diff(got[3], want[3]) < 1e-5  # the loaded model computes what the saved one did
        assert _max_diff(got[1], want[1]) < 1e-4
        assert set(got[2]) == set(want[2])
        assert max(float((got[2][k] - want[2][k]).abs().max()) for k in want[2]) < 1e-5
    assert dp2[0]["train/loss"] == pytest.approx(one[0]["train/loss"], abs=1e-6)
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert back[0][key] == want[0][key], key
    assert back[1] == want[1] and back[3] == want[3]
    assert all(torch.equal(back[2][k], want[2][k]) for k in want[2])
    for rank in range(2):
        _same_files(tmp_path / "ckpt_tp2", tmp_path / "ckpt_back", rank, rank)
        _same_files(tmp_path / "ckpt_one", tmp_path / "ckpt_dp2", 0, rank)
    assert SHAPE["num_key_value_heads"] == 2  # two query groups: one per TP rank


def test_a_layout_with_cp_is_refused_in_one_line_and_pp_goes_by_name(tmp_path):
    """CPU launches no CP / EP layout, so a checkpoint under one does not reshard; a PP change is read by
    name (``reshard_stages``, tested in test_megatron_pipeline_cpu.py), never by ``CPUReshard``."""
    from miles.errors import ComponentError
    from miles_megatron.layout import ParallelLayout
    from miles_megatron.reshard import CPUReshard

    one = ParallelLayout(world=1, tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, edp=1)
    cp2 = ParallelLayout(world=2, tp=1, pp=1, cp=2, ep=1, etp=1, dp=1, edp=1)
    pp2 = ParallelLayout(world=2, tp=1, pp=2, cp=1, ep=1, etp=1, dp=1, edp=1)
    with pytest.raises(
        ComponentError, match="reshard across tensor-, pipeline- and data-parallel sizes only"
    ):
        CPUReshard(str(tmp_path), cp2, one, 0)
    with pytest.raises(ComponentError, match="read by name"):
        CPUReshard(str(tmp_path), pp2, one, 0)


def test_a_lora_checkpoint_reshards_its_adapter(tmp_path):
    """A LoRA adapter on every projection (q, k, v and gate, up of the fused linears: ``lora_B`` split by
    rows; o, down: ``lora_A`` split by columns) saved on TP = 2 and loaded on one rank: the log-probs,
    the next step and the adapter after it are the TP = 2 run's within float noise, the base untouched."""
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    batches = [make_batch(n=5, seed=90 + i) for i in range(3)]

    def run(name, load=None, **megatron):
        spec = dataclasses.replace(
            _spec(path, **megatron), config={"lora": {"rank": 4, "alpha": 8.0, "target_modules": targets}}
        )
        backend = MegatronBackend()
        backend.setup(spec)
        try:
            if load is None:
                for b in batches[:2]:
                    backend.train_step(b)
                backend.save_checkpoint(str(tmp_path / "ckpt"))
            else:
                backend.load_checkpoint(str(load))
            before = backend.score(batches[2].samples, ["old_logprobs"])["old_logprobs"]
            metrics = backend.train_step(batches[2])
            backend.export_hf(str(tmp_path / name))  # the adapter, as peft saves it
            return metrics, before, load_file(str(tmp_path / name / "adapter_model.safetensors"))
        finally:
            backend.shutdown()

    want = run("tp2", num_ranks=2, tensor_parallel=2)
    got = run("one", load=tmp_path / "ckpt")
    assert _max_diff(got[1], want[1]) < 1e-5
    assert got[0]["train/loss"] == pytest.approx(want[0]["train/loss"], abs=1e-5)
    assert got[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=1e-5)
    assert set(got[2]) == set(want[2]) and len(want[2]) == 2 * len(targets) * SHAPE["num_hidden_layers"]
    assert max(float((got[2][k] - want[2][k]).abs().max()) for k in want[2]) < 1e-5
    assert min(float(want[2][k].abs().max()) for k in want[2] if "lora_B" in k) > 1e-3  # every B trained


def test_a_critic_checkpoint_reshards_with_the_policy(tmp_path):
    """PPO's critic (its value head replicated on every TP rank) saved on TP = 2, loaded on one rank: its
    values, and the next step of policy and critic, are the TP = 2 run's within float noise."""
    from miles.interfaces import CriticSpec

    path = make_checkpoint("qwen3", tmp_path / "hf")

    def ppo_batch(backend, seed: int):
        batch = make_batch(n=5, seed=seed)
        values = backend.score(batch.samples, ["values"])["values"]
        for sample, row in zip(batch.samples, values, strict=True):
            sample.token_scores["values"] = row
        batch.returns = [
            [float((i + j) % 3 - 1) for j in range(len(s.response_ids))] for i, s in enumerate(batch.samples)
        ]
        return batch, values

    def run(load=None, **megatron):
        spec = dataclasses.replace(
            _spec(path, **megatron),
            loss="ppo_clip",
            scores=["values"],
            critic=CriticSpec(model_path=str(path), lr=1e-2),
        )
        backend = MegatronBackend()
        backend.setup(spec)
        try:
            if load is None:
                for seed in (80, 81):
                    backend.train_step(ppo_batch(backend, seed)[0])
                backend.save_checkpoint(str(tmp_path / "ckpt"))
            else:
                backend.load_checkpoint(str(load))
            batch, values = ppo_batch(backend, 82)
            return backend.train_step(batch), values
        finally:
            backend.shutdown()

    want = run(num_ranks=2, tensor_parallel=2)
    got = run(load=tmp_path / "ckpt")
    assert _max_diff(got[1], want[1]) < 1e-5 and _max_diff(want[1], [[0.0] * len(r) for r in want[1]]) > 1e-3
    for key in ("critic/value_loss", "critic/values_mean", "train/loss"):
        assert got[0][key] == pytest.approx(want[0][key], abs=1e-5), key
    assert got[0]["critic/grad_norm"] == pytest.approx(want[0]["critic/grad_norm"], rel=1e-5)


def test_a_resume_may_change_tp_pp_and_the_rank_count_only():
    from miles.config.resume import check_resume_changes
    from miles.errors import ConfigError
    from miles_megatron.hooks import RESUME_MUTABLE

    mutable = [f"megatron.{k}" for k in RESUME_MUTABLE]
    old = {"megatron": {"device": "cpu", "num_ranks": 2, "tensor_parallel": 2, "pipeline_parallel": 1}}
    new = {"megatron": {"device": "cpu", "num_ranks": 1, "tensor_parallel": 1, "pipeline_parallel": 1}}
    assert set(check_resume_changes(old, new, mutable)) == {"megatron.num_ranks", "megatron.tensor_parallel"}
    changed = check_resume_changes(old, {"megatron": dict(new["megatron"], pipeline_parallel=2)}, mutable)
    assert "megatron.pipeline_parallel" in set(changed)
    with pytest.raises(ConfigError, match=r"--resume cannot change megatron\.context_parallel"):
        check_resume_changes(old, {"megatron": dict(new["megatron"], context_parallel=2)}, mutable)


@pytest.mark.extended
def test_miles_run_resumes_a_tp2_run_on_one_rank(tmp_path, monkeypatch):
    """``miles run`` on TP = 2 (two rank processes) saves at step 2; ``--resume`` with one rank continues."""
    from megatron_helpers import cpu_run_config, read_rows

    from miles.loop import train

    def config(steps: int, *layout: str):
        return cpu_run_config(tmp_path, monkeypatch, steps, *layout)

    train(config(3, "megatron.num_ranks=2", "megatron.tensor_parallel=2"))
    result = train(config(4), resume=True)
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint, on one rank
    assert rows[-1]["train/grad_norm"] > 0 and rows[-1]["correction/abs_dev"] < 1e-4


def test_streamed_optimizer_state_reshards_tp2_to_one_rank_and_back(tmp_path):
    """``megatron.optimizer_streaming`` (AdamW's FP32 masters and moments in per-rank bucket files, small
    buckets so that TP = 2 and one rank cut them differently): saved on TP = 2, loaded on one rank (the
    log-probs and the next step within float noise of the TP = 2 run's), saved there right after
    loading and loaded back on TP = 2: every bucket file's tensors are the first checkpoint's, bit for bit,
    and the next step is the first run's exactly."""
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(n=5, seed=100 + i) for i in range(3)]
    streamed = dict(optimizer_streaming=True, optimizer_streaming_bucket_mb=0.02)
    tp2 = dict(num_ranks=2, tensor_parallel=2)

    def run(save, load=None, **megatron):
        backend = MegatronBackend()
        backend.setup(_spec(path, **streamed, **megatron))
        try:
            if load is None:
                for b in batches[:2]:
                    backend.train_step(b)
            else:
                backend.load_checkpoint(str(load))
            backend.save_checkpoint(str(save))
            before = backend.score(batches[2].samples, ["old_logprobs"])["old_logprobs"]
            return backend.train_step(batches[2]), before
        finally:
            backend.shutdown()

    want = run(tmp_path / "s2", **tp2)
    one = run(tmp_path / "s1", load=tmp_path / "s2")
    back = run(tmp_path / "s2b", load=tmp_path / "s1", **tp2)
    assert _max_diff(one[1], want[1]) < 1e-5
    assert one[0]["train/loss"] == pytest.approx(want[0]["train/loss"], abs=1e-5)
    assert one[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=1e-5)
    for key in ("train/loss", "train/grad_norm"):
        assert back[0][key] == want[0][key], key
    assert back[1] == want[1]
    for rank in ("rank00000", "rank00001"):
        a, b = tmp_path / "s2" / "streaming" / rank, tmp_path / "s2b" / "streaming" / rank
        files = sorted(p.name for p in a.glob("bucket-*.safetensors"))
        assert files == sorted(p.name for p in b.glob("bucket-*.safetensors")) and len(files) > 2
        for name in files:
            x, y = load_file(str(a / name)), load_file(str(b / name))
            assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x), (rank, name)
    ones = sorted(p.name for p in (tmp_path / "s1" / "streaming" / "rank00000").glob("bucket-*.safetensors"))
    assert len(ones) != len(files)  # one rank cut its buckets otherwise
