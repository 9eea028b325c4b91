"""Optimizer-state streaming (``miles_megatron.streaming``) on CPU.

The optimizer alone against ``torch.optim.AdamW`` (bit for bit with FP32 moments), what is
resident, the checkpoint manifest and its refusals; then the real backend on one gloo rank
(``megatron.device: cpu``): a streamed run equals the torch-AdamW run step for step, resumes
from its checkpoint with the same next loss, and refuses checkpoints of the other kind.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from miles.errors import ComponentError
from miles_megatron.streaming import (
    MANIFEST,
    STATE_PREFIX,
    StreamedParam,
    StreamingAdamW,
    StreamingConfig,
    plan_buckets,
    state_bytes,
)

LAYOUT = {"tensor_model_parallel_size": 1, "world": 1, "rank": 0}
SHAPES = [(6, 5), (5,), (7, 3), (3,), (40,), (4, 4)]  # 2-D decay, 1-D does not (megatron's groups)
BETAS = (0.9, 0.95)


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _streamed(params, directory, bucket_bytes=300, **kw) -> StreamingAdamW:
    named = [StreamedParam(f"p{i}", p, 0.1 if p.dim() > 1 else 0.0) for i, p in enumerate(params)]
    config = StreamingConfig(bucket_bytes=bucket_bytes, betas=BETAS, eps=1e-8, **kw)
    return StreamingAdamW(named, config, LAYOUT, str(directory))


def _grads(step: int, like: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in like]


def _torch_adamw(params):
    groups = [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=BETAS, eps=1e-8)


LRS = [1e-2, 5e-3, 2e-2, 1e-3]  # a schedule: the lr is the caller's at every step


def test_buckets_are_consecutive_and_bounded():
    numels = [30, 5, 21, 3, 40, 16]
    buckets = plan_buckets(numels, 300, "float32")  # 12 bytes per element
    assert [i for b in buckets for i in b] == list(range(6))
    assert buckets == [[0], [1], [2, 3], [4], [5]]  # 30 * 12 = 360 > 300: alone; 60 + 252 > 300
    for b in buckets:
        assert len(b) == 1 or sum(state_bytes(numels[i], "float32") for i in b) <= 300
    assert plan_buckets(numels, 10**6, "bfloat16") == [list(range(6))]
    assert state_bytes(10, "bfloat16") == 80


@pytest.mark.parametrize("prefetch", [False, True])
def test_fp32_moments_equal_torch_adamw_bit_for_bit_one_bucket_resident(tmp_path, prefetch):
    ours, theirs = _params(), _params()
    opt = _streamed(ours, tmp_path, prefetch=prefetch)
    ref = _torch_adamw(theirs)
    n = len(opt.buckets)
    assert n == 5
    sizes = [sum(state_bytes(ours[i].numel(), "float32") for i in b) for b in opt.buckets]
    for step, lr in enumerate(LRS):
        for p, q, g in zip(ours, theirs, _grads(step, ours), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        opt.step(lr)
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q), step
    assert opt.loads == n * len(LRS)
    total = sum(sizes)
    if prefetch:  # this bucket and the next one, read ahead
        assert opt.peak_resident_bytes <= max(a + b for a, b in itertools.pairwise(sizes))
    else:
        assert opt.peak_resident_bytes == max(sizes)
    assert opt.peak_resident_bytes < total and opt.resident_bytes == 0
    opt.close()


def test_bf16_moments_stay_close_and_bf16_params_follow_their_fp32_master(tmp_path):
    fp32, bf16m, bf16p = _params(), _params(), _params(dtype=torch.bfloat16)
    a = _streamed(fp32, tmp_path)
    b = _streamed(bf16m, tmp_path, moments="bfloat16")
    c = _streamed(bf16p, tmp_path)
    for step, lr in enumerate(LRS):
        for params in (fp32, bf16m, bf16p):
            for p, g in zip(params, _grads(step, params), strict=True):
                p.grad = g.to(p.dtype)
        for opt in (a, b, c):
            opt.step(lr)
    for p, q in zip(fp32, bf16m, strict=True):
        assert not torch.equal(p, q) or p.numel() == 0  # the rounding shows...
        assert torch.allclose(p, q, atol=2e-3, rtol=0)  # ...and stays small
    assert all(p.dtype == torch.bfloat16 for p in bf16p)
    # The bf16 parameters are their FP32 master rounded, the master itself kept the small updates.
    c.save(str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    masters = {}
    for f in sorted(os.listdir(tmp_path / "ckpt")):
        if f.endswith(".safetensors"):
            masters.update(load_file(str(tmp_path / "ckpt" / f)))
    for i, p in enumerate(bf16p):
        master = masters[f"p{i}.master"]
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))
    stored = load_file(str(tmp_path / "ckpt" / "bucket-00000.safetensors"))
    assert stored["p0.exp_avg"].dtype == torch.float32
    b.save(str(tmp_path / "ckpt-bf16"))
    assert (
        load_file(str(tmp_path / "ckpt-bf16" / "bucket-00000.safetensors"))["p0.exp_avg"].dtype
        == torch.bfloat16
    )
    for opt in (a, b, c):
        opt.close()


def test_a_parameter_without_gradient_is_left_alone_as_torch_does(tmp_path):
    ours, theirs = _params(), _params()
    opt, ref = _streamed(ours, tmp_path), _torch_adamw(theirs)
    for step in range(2):
        for i, (p, q, g) in enumerate(zip(ours, theirs, _grads(step, ours), strict=True)):
            p.grad = q.grad = None if (i == 2 and step == 0) else g
        ref.step()
        opt.step(1e-2)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


def test_checkpoint_round_trip_and_refusals(tmp_path):
    params = _params()
    (tmp_path / "work").mkdir()
    opt = _streamed(params, tmp_path / "work", prefetch=False)
    for step in range(2):
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g
        opt.step(1e-2)
    opt.save(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["layout"] == LAYOUT and manifest["moments"] == "float32"
    assert manifest["buckets"][2] == [["p2", [7, 3]], ["p3", [3]]]
    # the next step of the saved optimizer...
    grads = _grads(2, params)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step(1e-2)
    want = [p.detach().clone() for p in params]
    # ...equals a fresh one (other weights) resumed from the checkpoint
    fresh = _params(seed=7)
    again = _streamed(fresh, tmp_path / "work")
    again.load(str(tmp_path / "ckpt"))
    for p, g in zip(fresh, grads, strict=True):
        p.grad = g
    again.step(1e-2)
    assert all(torch.equal(p, w) for p, w in zip(fresh, want, strict=True))

    other = _params()
    with pytest.raises(
        ComponentError, match=r"another parallel layout .*'tensor_model_parallel_size': \(1, 2\)"
    ):
        named = [StreamedParam(f"p{i}", p, 0.0) for i, p in enumerate(other)]
        cfg = StreamingConfig(bucket_bytes=300, betas=BETAS, eps=1e-8)
        StreamingAdamW(named, cfg, {**LAYOUT, "tensor_model_parallel_size": 2}, str(tmp_path)).load(
            str(tmp_path / "ckpt")
        )
    with pytest.raises(
        ComponentError, match=r"buckets \(5\) differ from this run.s \(1\).*optimizer_streaming_bucket_mb"
    ):
        _streamed(other, tmp_path, bucket_bytes=10**6).load(str(tmp_path / "ckpt"))
    with pytest.raises(ComponentError, match="moments in float32, this run in bfloat16"):
        _streamed(other, tmp_path, moments="bfloat16").load(str(tmp_path / "ckpt"))
    with pytest.raises(ComponentError, match="holds no streamed optimizer state"):
        _streamed(other, tmp_path).load(str(tmp_path))
    opt.close()
    again.close()


def test_close_removes_only_what_it_created(tmp_path):
    (tmp_path / "keep.txt").write_text("not the optimizer's")
    opt = _streamed(_params(), tmp_path)
    made = [p for p in tmp_path.iterdir() if p.name.startswith(STATE_PREFIX)]
    assert len(made) == 1 and len(list(made[0].iterdir())) == len(opt.buckets)
    opt.close()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    stray = _streamed(_params(), tmp_path)
    (tmp_path / os.path.basename(stray.directory) / "theirs.txt").write_text("x")
    stray.close()  # its own files go, the directory with someone else's file stays
    assert (tmp_path / os.path.basename(stray.directory) / "theirs.txt").exists()
    assert len(list((tmp_path / os.path.basename(stray.directory)).iterdir())) == 1


# ---------------------------------------------------------------------------- the trainer, one gloo rank


def _spec(path, **megatron):
    from miles.interfaces import BackendSpec

    return BackendSpec(
        model_path=str(path),
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {
                "lr": 1e-2,
                "micro_batch_size": 2,
                "grad_clip": 0.5,  # below the norms of this model: every step clips
                "weight_decay": 0.1,
                "lr_schedule": "linear",
                "warmup_steps": 1,
                "lr_decay_steps": 4,
            },
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _start(spec):
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    backend.setup(spec)
    return backend


def _params_of(backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.trainer.gpt.named_parameters()}


STREAMED = dict(optimizer_streaming=True, optimizer_streaming_bucket_mb=0.02)  # ~20 KB: several buckets


@pytest.mark.slow
def test_a_streamed_cpu_run_equals_torch_adamw_and_resumes_from_its_checkpoint(tmp_path):
    from megatron_helpers import make_batch, make_checkpoint

    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(4, seed=40 + i) for i in range(3)]
    plain = _start(
        _spec(path)
    )  # torch's AdamW (megatron's global state allows one rank per process at a time)
    try:
        want = [plain.train_step(b) for b in batches]
        want_params = _params_of(plain)
    finally:
        plain.shutdown()
    streamed = _start(_spec(path, **STREAMED))
    try:
        got = []
        for i, b in enumerate(batches):
            got.append(streamed.train_step(b))
            if i == 1:
                streamed.save_checkpoint(str(tmp_path / "ckpt"))
        got_params = _params_of(streamed)
        opt = streamed.trainer.streaming
        assert len(opt.buckets) >= 4 and opt.loads == 3 * len(opt.buckets)
        total = sum(state_bytes(p.param.numel(), "float32") for p in opt.params)
        peak = got[-1]["optimizer/streamed_peak_resident_bytes"]
        assert 0 < peak < total / 2, (peak, total)
    finally:
        streamed.shutdown()
    for w, g in zip(want, got, strict=True):
        assert w["train/grad_norm"] > 0.5  # clipped
        assert g["train/lr"] == w["train/lr"] and g["train/loss"] == w["train/loss"]
        assert g["train/grad_norm"] == w["train/grad_norm"]
    assert [w["train/lr"] for w in want] == pytest.approx([1e-2, 1e-2, 1e-2 * 2 / 3])  # warmup, then decay
    for name, p in want_params.items():
        assert torch.equal(got_params[name], p), name  # torch's AdamW update, bit for bit

    resumed = _start(_spec(path, **STREAMED))
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.trainer.optimizer_steps == 2
        again = resumed.train_step(batches[2])
        assert again["train/loss"] == got[2]["train/loss"] and again["train/lr"] == got[2]["train/lr"]
        assert all(torch.equal(p, got_params[k]) for k, p in _params_of(resumed).items())
    finally:
        resumed.shutdown()

    other = _start(_spec(path, optimizer_streaming=True, optimizer_streaming_bucket_mb=1.0))
    try:
        with pytest.raises(ComponentError, match=r"buckets .* differ"):
            other.load_checkpoint(str(tmp_path / "ckpt"))
        # A checkpoint of megatron's own optimizer (its marker as save_checkpoint writes it on CUDA) is refused.
        marker = json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "miles_megatron.json").write_text(
            json.dumps({**marker, "optimizer": "megatron"})
        )
        with pytest.raises(
            ComponentError, match=r"optimizer_streaming is on but checkpoint .* written without it"
        ):
            other.load_checkpoint(str(tmp_path / "plain"))
    finally:
        other.shutdown()
    plain = _start(_spec(path))
    try:  # and a streamed checkpoint by a run without streaming, before anything is read
        with pytest.raises(ComponentError, match=r"written with megatron\.optimizer_streaming"):
            plain.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        plain.shutdown()


@pytest.mark.slow
def test_bf16_moments_train_close_to_fp32_ones(tmp_path):
    from megatron_helpers import make_batch, make_checkpoint

    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(4, seed=50 + i) for i in range(3)]
    runs = []
    for moments in ("float32", "bfloat16"):
        backend = _start(_spec(path, optimizer_streaming_moments=moments, **STREAMED))
        try:
            losses = [backend.train_step(b)["train/loss"] for b in batches]
            runs.append((losses, _params_of(backend)))
        finally:
            backend.shutdown()
    (l32, p32), (l16, p16) = runs
    assert l16[0] == l32[0] and l16[1:] == pytest.approx(l32[1:], abs=1e-3)
    drift = max(float((p32[k] - p16[k]).abs().max()) for k in p32)
    assert 0 < drift < 1e-3, drift


def test_streaming_options_are_checked_before_any_model_work(tmp_path):
    from pydantic import ValidationError

    from miles_megatron.config import MegatronOptions

    on = MegatronOptions(optimizer_streaming=True, optimizer_streaming_dir=str(tmp_path))
    assert on.storage_problems() == [] and on.optimizer_streaming_moments == "float32"
    assert on.optimizer_streaming_prefetch and on.optimizer_streaming_bucket_mb == 256.0
    with pytest.raises(
        ValidationError, match=r"optimizer_streaming_dir is set but megatron\.optimizer_streaming is false"
    ):
        MegatronOptions(optimizer_streaming_dir=str(tmp_path))
    with pytest.raises(ValidationError, match="optimizer_streaming_bucket_mb"):
        MegatronOptions(optimizer_streaming=True, optimizer_streaming_bucket_mb=0)
    with pytest.raises(ValidationError, match="optimizer_streaming_moments"):
        MegatronOptions(optimizer_streaming=True, optimizer_streaming_moments="float16")  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    for where, said in [(tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory")]:
        problems = MegatronOptions(
            optimizer_streaming=True, optimizer_streaming_dir=str(where)
        ).storage_problems()
        assert problems == [
            f"megatron.optimizer_streaming_dir {str(where)!r} {said}; "
            "allowed: an existing, writable directory on node-local disk"
        ]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        StreamingConfig(bucket_bytes=0, betas=BETAS, eps=1e-8)
    with pytest.raises(ValueError, match="moments must be one of"):
        StreamingConfig(bucket_bytes=1, betas=BETAS, eps=1e-8, moments="float16")
