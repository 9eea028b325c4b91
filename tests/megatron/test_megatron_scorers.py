"""The Megatron backend's frozen scorers on CPU (``megatron.device: cpu``): the reference policy
(KL penalties) and a teacher (on-policy distillation), each a forward-only megatron model of its HF
directory on the policy's layout.

The reference scores the policy's initial weights and does not move when the policy trains; a KL
term against it is 0 at the first step and positive after; the teacher's log-probs equal those a
policy built from the teacher's checkpoint gives; DP = 2 ranks return every score in the batch's
order; what cannot be scored is refused in one line.
"""

from __future__ import annotations

import pytest
from megatron_helpers import make_batch, make_checkpoint

from miles.errors import ConfigError, ModelError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow

REF, TEACHER, OLD = "ref_logprobs", "teacher_logprobs", "old_logprobs"


def _spec(path, scores=(), loss_options=None, ref=None, teacher=None, **megatron) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        loss_options=loss_options or {},
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        scores=list(scores),
        ref_model_path=None if ref is None else str(ref),
        teacher_model_path=None if teacher is None else str(teacher),
        options={
            "train": {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_the_reference_is_the_initial_policy_and_stays_while_the_policy_trains(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    backend = MegatronBackend()
    backend.setup(_spec(path, scores=[REF], loss_options={"kl_coef": 0.5}))
    try:
        batch = make_batch(n=5, seed=3)
        first = backend.score(batch.samples, [REF, OLD])
        assert _max_diff(first[REF], first[OLD]) < 1e-6
        kls = []
        for _ in range(2):
            refs = backend.score(batch.samples, [REF])[REF]
            for sample, row in zip(batch.samples, refs, strict=True):
                sample.token_scores[REF] = row
            kls.append(backend.train_step(batch)["loss/kl_loss"])
        after = backend.score(batch.samples, [REF, OLD])
        assert after[REF] == first[REF]  # frozen: bit for bit
        assert _max_diff(after[OLD], first[OLD]) > 1e-3  # while the policy moved
        assert abs(kls[0]) < 1e-6 < kls[1]
    finally:
        backend.shutdown()


def test_the_teacher_scores_like_a_policy_built_from_its_checkpoint_and_dp2_keeps_the_order(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    teacher = make_checkpoint("qwen3", tmp_path / "teacher", seed=7)
    batch = make_batch(n=5, seed=4)

    def scores(model, names, **kwargs):
        backend = MegatronBackend()
        backend.setup(_spec(model, **kwargs))
        try:
            return backend.score(batch.samples, names)
        finally:
            backend.shutdown()

    as_policy = scores(teacher, [OLD])[OLD]
    one = scores(path, [TEACHER, REF, OLD], scores=[TEACHER, REF], teacher=teacher)
    assert _max_diff(one[TEACHER], as_policy) < 1e-6
    assert _max_diff(one[REF], one[OLD]) < 1e-6
    assert _max_diff(one[TEACHER], one[OLD]) > 1e-3  # another model
    two = scores(path, [TEACHER, REF, OLD], scores=[TEACHER, REF], teacher=teacher, num_ranks=2)
    for name in (TEACHER, REF, OLD):
        assert _max_diff(two[name], one[name]) < 1e-6, name


def test_what_cannot_be_scored_is_refused_in_one_line(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    with pytest.raises(ConfigError, match="needs teacher_logprobs but no teacher model is named"):
        MegatronBackend().setup(_spec(path, scores=[TEACHER]))
    with pytest.raises(ConfigError, match=r"needs values but no critic is set \(algorithm.critic\)"):
        MegatronBackend().setup(_spec(path, scores=["values"]))
    with pytest.raises(ModelError, match=r"reference model path .* is not a Hugging Face model directory"):
        MegatronBackend().setup(_spec(path, scores=[REF], ref=tmp_path))
    wide = make_checkpoint("qwen3", tmp_path / "wide", vocab_size=128)
    with pytest.raises(ModelError, match="has a vocabulary of 128, the policy 96"):
        MegatronBackend().setup(_spec(path, scores=[TEACHER], teacher=wide))
