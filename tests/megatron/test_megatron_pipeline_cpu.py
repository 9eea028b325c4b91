"""Pipeline parallelism on CPU over gloo (``megatron.device: cpu``): PP = 2 through megatron-core's schedule.

One tiny Qwen3 checkpoint (untied embeddings, 4 layers: 2 per stage) and one batch of 5 samples in
micro-batches of 2 (3 micro-batches of different shapes through the 1F1B schedule), trained by the
real backend on one rank and on two pipeline stages (and PP x TP, PP x DP on four ranks): the
log-probs before the step, the step's loss and gradient norm, and the log-probs after it agree; the
HF export (each stage's layers relayed to rank 0) equals the checkpoint's tensors bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import checkpoint_tensors, cpu_run_config, make_batch, make_checkpoint, read_rows
from safetensors.torch import load_file

from miles.errors import ComponentError, ConfigError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow


def _spec(path, **megatron) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        scores=["ref_logprobs"],  # the frozen reference model runs on the stages too
        options={
            # eps well above float noise (as test_megatron_ranks_cpu): Adam's first step is lr * g / (|g| + eps).
            "train": {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.01},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _checkpoint(tmp_path, tied=False):
    return make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=tied, num_hidden_layers=4)


def _run(path, out, **megatron):
    backend = MegatronBackend()
    backend.setup(_spec(path, **megatron))
    try:
        batch = make_batch(n=5, seed=1)
        backend.export_hf(str(out))
        before = backend.score(batch.samples, ["old_logprobs"])["old_logprobs"]
        metrics = backend.train_step(batch)
        after = backend.score(batch.samples, ["old_logprobs", "ref_logprobs"])
        assert _gap(after["ref_logprobs"], before) < 1e-5  # the reference is the initial policy, frozen
        return before, metrics, after["old_logprobs"]
    finally:
        backend.shutdown()


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _same_run(one, other) -> None:
    assert _gap(one[0], other[0]) < 1e-5
    assert abs(one[1]["train/loss"] - other[1]["train/loss"]) < 1e-5
    assert abs(one[1]["train/grad_norm"] - other[1]["train/grad_norm"]) < 1e-5
    assert one[1]["train/num_tokens"] == other[1]["train/num_tokens"]
    assert _gap(one[2], other[2]) < 1e-5  # one AdamW step on the stages == on the whole model
    assert _gap(one[0], one[2]) > 1e-3  # and the step changed the model


def _export_is_the_checkpoint(path, out) -> None:
    hf = checkpoint_tensors(path)
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pp2_over_gloo_equals_one_rank(tmp_path, tied):
    """Tied: megatron's copy of the embedding on the last stage is the output layer's weight; their
    gradients are summed over the embedding group, so both take the one-rank update."""
    path = _checkpoint(tmp_path, tied)
    one = _run(path, tmp_path / "one")
    two = _run(path, tmp_path / "pp2", num_ranks=2, pipeline_parallel=2)
    _same_run(one, two)
    _export_is_the_checkpoint(path, tmp_path / "pp2")


@pytest.mark.parametrize(
    ("other", "tied"),
    [
        (dict(pipeline_parallel=2, tensor_parallel=2), False),
        (dict(pipeline_parallel=2), False),
        # four stages of one layer: middle stages hold neither the embedding nor its tied copy
        (dict(pipeline_parallel=4), True),
    ],
    ids=["pp2-tp2", "pp2-dp2", "pp4-tied"],
)
def test_four_ranks_with_stages_equal_one_rank(tmp_path, other, tied):
    path = _checkpoint(tmp_path, tied)
    one = _run(path, tmp_path / "one")
    four = _run(path, tmp_path / "four", num_ranks=4, **other)
    _same_run(one, four)
    _export_is_the_checkpoint(path, tmp_path / "four")


def test_pp_refusals_in_one_line(tmp_path):
    from miles_megatron.config import MegatronOptions
    from miles_megatron.hooks import launch_problems

    assert launch_problems(MegatronOptions(num_ranks=2, pipeline_parallel=2, device="cpu")) == []
    (problem,) = launch_problems(MegatronOptions(num_ranks=2, pipeline_parallel=2, device="cuda"))
    assert "pipeline stages run on megatron.device cpu only" in problem
    (problem,) = launch_problems(
        MegatronOptions(num_ranks=2, pipeline_parallel=2, device="cpu", optimizer_streaming=True)
    )
    assert "optimizer_streaming" in problem
    with pytest.raises(ConfigError, match=r"4 layers do not split into PP=3 stages"):
        MegatronBackend().setup(_spec(_checkpoint(tmp_path), num_ranks=3, pipeline_parallel=3))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _exported(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _resume(path, ckpt, batch, out, **megatron) -> float:
    """Load ``ckpt`` under ``megatron``'s layout, take one step on ``batch``, export to ``out``: the step's loss."""
    backend = MegatronBackend()
    backend.setup(_spec(path, **megatron))
    try:
        backend.load_checkpoint(str(ckpt))
        loss = backend.train_step(batch)["train/loss"]
        backend.export_hf(str(out))
        return float(loss)
    finally:
        backend.shutdown()


def test_pp2_checkpoint_resumes_exactly_and_on_other_layouts(tmp_path):
    """Each stage's ranks save their own files; resumed on PP = 2 the next step's loss and the weights
    after it equal the uninterrupted run's bit for bit; resumed on one rank (PP = 1) and on PP = 2 x TP = 2
    (each rank's tensors and AdamW state found by name in the saved stages, ``reshard_stages``) they agree
    within float rounding; a checkpoint without its parameter names is refused in one line."""
    path = _checkpoint(tmp_path)
    batches = [make_batch(n=5, seed=80 + i) for i in range(3)]
    pp2 = dict(num_ranks=2, pipeline_parallel=2)
    ckpt = tmp_path / "ckpt"
    first = MegatronBackend()
    first.setup(_spec(path, **pp2))
    try:
        losses = []
        for i, batch in enumerate(batches):
            losses.append(first.train_step(batch)["train/loss"])
            if i == 1:
                first.save_checkpoint(str(ckpt))
        first.export_hf(str(tmp_path / "first"))
    finally:
        first.shutdown()
    assert sorted(p.name for p in (ckpt / "cpu").iterdir()) == ["rank00000", "rank00001"]
    want = _exported(tmp_path / "first")
    assert _resume(path, ckpt, batches[2], tmp_path / "same", **pp2) == losses[2]
    got = _exported(tmp_path / "same")
    assert all(torch.equal(want[k], got[k]) for k in want)
    for name, layout in (("one", {}), ("pp2-tp2", dict(num_ranks=4, pipeline_parallel=2, tensor_parallel=2))):
        assert abs(_resume(path, ckpt, batches[2], tmp_path / name, **layout) - losses[2]) < 1e-5, name
        assert _max_diff(_exported(tmp_path / name), want) < 1e-5, name
    (ckpt / "cpu" / "rank00001" / "param_names.json").unlink()
    one = MegatronBackend()
    one.setup(_spec(path))
    try:
        with pytest.raises(ComponentError, match=r"does not record its ranks' parameter names") as err:
            one.load_checkpoint(str(ckpt))
        assert "\n" not in str(err.value)
    finally:
        one.shutdown()


def test_a_tied_one_rank_checkpoint_resumes_on_two_stages(tmp_path):
    """A tied model saved on one rank resumes on PP = 2: the last stage's copy of the embedding (and its
    AdamW state) is read from the saved embedding; the next step's loss and weights are one rank's."""
    path = _checkpoint(tmp_path, tied=True)
    batches = [make_batch(n=5, seed=90 + i) for i in range(2)]
    first = MegatronBackend()
    first.setup(_spec(path))
    try:
        first.train_step(batches[0])
        first.save_checkpoint(str(tmp_path / "ckpt"))
        loss = first.train_step(batches[1])["train/loss"]
        first.export_hf(str(tmp_path / "first"))
    finally:
        first.shutdown()
    pp2 = dict(num_ranks=2, pipeline_parallel=2)
    assert abs(_resume(path, tmp_path / "ckpt", batches[1], tmp_path / "pp2", **pp2) - loss) < 1e-5
    assert _max_diff(_exported(tmp_path / "pp2"), _exported(tmp_path / "first")) < 1e-5


def test_miles_run_with_pp2_passes_the_weight_equality_check(tmp_path, monkeypatch):
    """``miles run`` of the default recipe's tiny Qwen3 (4 layers, tied embeddings) on two pipeline stages
    with the embedded engine, the colocated transport and the weight-equality check on: every engine tensor equals the trainer's after the first update (each
    stage's layers relayed to rank 0), and the engine serves the trained weights (log-prob gap ~ 0)."""
    from miles.loop import train

    config = cpu_run_config(
        tmp_path,
        monkeypatch,
        2,
        "weight_sync.check_equal=true",
        'megatron={"device": "cpu", "params_dtype": "float32", "num_ranks": 2, "pipeline_parallel": 2}',
    )
    rows = read_rows(train(config).metrics_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert all(r["correction/abs_dev"] < 1e-4 for r in rows)
    assert [r["engine/weight_version"] for r in rows] == [1, 2]


@pytest.mark.extended
def test_miles_run_resumes_a_pp2_run_on_one_rank(tmp_path, monkeypatch):
    """``miles run`` on PP = 2 saves at step 2; ``--resume`` on one rank (PP = 1) continues from it."""
    from miles.loop import train

    def config(steps: int, *layout: str):
        return cpu_run_config(tmp_path, monkeypatch, steps, *layout)

    train(config(3, "megatron.num_ranks=2", "megatron.pipeline_parallel=2"))
    result = train(config(4), resume=True)
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint, on one rank
    assert rows[-1]["train/grad_norm"] > 0 and rows[-1]["correction/abs_dev"] < 1e-4
