"""The served teacher: routing, recorded log-probs, the top-K estimate and the tokenizer check.

Two real embedded engines serve this module: the student (tiny Qwen3, seed 0) and a
teacher with other weights (seed 1) but the same word-level tokenizer. Expected values
come from local forwards of the two checkpoints.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine.helpers import VOCAB, load_local, make_tiny_qwen3, running_engine

from miles.builtins.rollout.default import GroupRollout
from miles.distill import OPD_REVERSE_KL, ServedTeacher, check_same_tokenizer
from miles.engines.client import SGLangClient
from miles.errors import ConfigError, EngineError
from miles.interfaces import TEACHER_LOGPROBS, RolloutContext
from miles.types import Prompt, Sample, SamplingParams, Status

T = 0.8


# ------------------------------------------------------------------ without engines


def test_bad_options_are_config_errors() -> None:
    cases = [
        ({"teachers": {}}, "at least one name"),
        ({"teachers": {"default": 3}}, r"\['default'\] are neither"),
        ({"teachers": {"default": "h:1"}, "top_k": -1}, "top_k must be an integer >= 0"),
        ({"teachers": {"default": "h:1"}, "temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"teachers": {"default": "h:1"}, "candidates": "union"}, "candidates 'union' is not one of"),
        ({"teachers": {"default": "h:1"}, "route_key": ""}, "route_key"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            ServedTeacher(**kwargs)


def test_routing_by_the_prompt_tag_else_the_default_teacher() -> None:
    scorer = ServedTeacher(
        {"default": "http://a:1", "math": "http://b:2", "7": "http://c:3"}, route_key="domain"
    )

    def sample(metadata: dict) -> Sample:
        return Sample(prompt=Prompt(index=4, prompt="w1", metadata=metadata))

    assert scorer.teacher_for(sample({}))[0] == "default"
    assert scorer.teacher_for(sample({"domain": "math"})) == ("math", scorer.teachers["math"])
    assert scorer.teacher_for(sample({"domain": 7}))[0] == "7"
    assert scorer.teacher_for(sample({"teacher": "math"}))[0] == "default"  # another key: not a tag
    with pytest.raises(
        ValueError,
        match=r"prompt 4 is tagged domain='code', which names no teacher \(teachers: 7, default, math\)",
    ):
        scorer.teacher_for(sample({"domain": "code"}))
    no_default = ServedTeacher({"math": "http://b:2"})
    with pytest.raises(
        ValueError, match="has no 'teacher' tag in its metadata and there is no 'default' teacher"
    ):
        no_default.teacher_for(sample({}))


def test_an_empty_response_is_recorded_without_calling_the_teacher() -> None:
    # Nothing listens on port 9: a call would fail.
    scorer = ServedTeacher({"default": "http://127.0.0.1:9"}, top_k=2)
    sample = Sample(prompt=Prompt(index=0, prompt="w1"), prompt_ids=[1])
    asyncio.run(scorer(None, sample))  # type: ignore[arg-type]
    assert sample.token_scores == {TEACHER_LOGPROBS: [], OPD_REVERSE_KL: []}


# -------------------------------------------------------------------- with engines


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    return {
        "student": make_tiny_qwen3(root / "student", seed=0, tokenizer=True),
        "teacher": make_tiny_qwen3(root / "teacher", seed=1, tokenizer=True),
        "logs": root / "logs",
    }


@pytest.fixture(scope="module")
def urls(dirs: dict[str, Path]):
    with (
        running_engine(dirs["student"], dirs["logs"] / "student") as student,
        running_engine(dirs["teacher"], dirs["logs"] / "teacher") as teacher,
    ):
        yield {"student": student, "teacher": teacher}


@pytest.fixture(scope="module")
def models(dirs: dict[str, Path]):
    return {name: load_local(dirs[name]) for name in ("student", "teacher")}


def local_logp(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / T, dim=-1)


def rollout(engines: dict[str, str], scorer: ServedTeacher, prompts: list[Prompt]) -> list[Sample]:
    """The built-in rollout on the student engine, with ``scorer`` run on every finished sample."""
    from transformers import AutoTokenizer

    student = SGLangClient(engines["student"])
    ctx = RolloutContext(
        engines=[student],
        tokenizer=AutoTokenizer.from_pretrained(engines["student_dir"]),
        sampling=SamplingParams(max_new_tokens=8, temperature=T, seed=17),
        n_samples_per_prompt=1,
        reward=lambda sample: 0.0,
        scorers=[scorer],
    )

    async def go() -> list[Sample]:
        try:
            groups = await GroupRollout()(ctx, prompts)
        finally:
            await student.aclose()
            await scorer.aclose()
        return [g.samples[0] for g in groups]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def engines(urls: dict[str, str], dirs: dict[str, Path]) -> dict[str, str]:
    return {**urls, "student_dir": str(dirs["student"])}


def expected_reverse_kl(s: torch.Tensor, t: torch.Tensor, sampled: int, k: int, candidates: str) -> float:
    """The top-K estimate at one position from full log-prob rows: softmax-weighted log-ratios over C."""
    ids = torch.topk(s, k).indices.tolist()
    if candidates == "intersection":
        teacher_top = set(torch.topk(t, k).indices.tolist())
        ids = [i for i in ids if i in teacher_top]
        if not ids:
            return float(s[sampled] - t[sampled])
    w = torch.softmax(s[ids], dim=0)
    return float((w * (s[ids] - t[ids])).sum())


@pytest.mark.slow
def test_teacher_logprobs_are_routed_by_tag_and_recorded_per_token(engines: dict[str, str], models) -> None:
    scorer = ServedTeacher({"default": engines["student"], "other": engines["teacher"]}, temperature=T)
    prompts = [
        Prompt(index=0, prompt="w3 w1 w4 w1"),
        Prompt(index=1, prompt="w5 w9 w2", metadata={"teacher": "other"}),
        Prompt(index=2, prompt="w6 w5", metadata={"teacher": "nobody"}),
    ]
    same, other, unknown = rollout(engines, scorer, prompts)
    # Untagged: the default teacher, here the student's own engine: it gives back the rollout log-probs.
    assert same.status is Status.TRUNCATED and len(same.response_ids) == 8
    assert same.token_scores[TEACHER_LOGPROBS] == pytest.approx(same.rollout_logprobs, abs=1e-5)
    # Tagged "other": the seed-1 teacher's log-probs of the student's tokens, at the rollout temperature.
    ids = other.prompt_ids + other.response_ids
    logp = local_logp(models["teacher"], ids)
    p = len(other.prompt_ids)
    expected = [float(logp[p - 1 + j, tok]) for j, tok in enumerate(other.response_ids)]
    assert other.token_scores[TEACHER_LOGPROBS] == pytest.approx(expected, abs=1e-4)
    assert other.token_scores[TEACHER_LOGPROBS] != pytest.approx(other.rollout_logprobs, abs=1e-3)
    assert OPD_REVERSE_KL not in other.token_scores
    # An unknown tag fails that sample (not the rollout), with a message naming the tag and the teachers.
    assert unknown.status is Status.FAILED and unknown.reward == 0.0
    assert "tagged teacher='nobody'" in unknown.metadata["scorer_error"]
    assert "(teachers: default, other)" in unknown.metadata["scorer_error"]


@pytest.mark.slow
@pytest.mark.parametrize("candidates", ["student", "intersection"])
def test_top_k_estimate_end_to_end(engines: dict[str, str], models, candidates: str) -> None:
    k = 4
    scorer = ServedTeacher(
        {"default": engines["teacher"], "self": engines["student"]},
        temperature=T,
        top_k=k,
        candidates=candidates,
    )
    prompts = [
        Prompt(index=0, prompt="w7 w3 w9 w1"),
        Prompt(index=1, prompt="w7 w3 w9 w1", metadata={"teacher": "self"}),
    ]
    sample, own = rollout(engines, scorer, prompts)
    ids = sample.prompt_ids + sample.response_ids
    s, t = local_logp(models["student"], ids), local_logp(models["teacher"], ids)
    p = len(sample.prompt_ids)
    expected = [
        expected_reverse_kl(s[p - 1 + j], t[p - 1 + j], tok, k, candidates)
        for j, tok in enumerate(sample.response_ids)
    ]
    assert sample.token_scores[OPD_REVERSE_KL] == pytest.approx(expected, abs=1e-4)
    assert sample.token_scores[TEACHER_LOGPROBS] == pytest.approx(
        [float(t[p - 1 + j, tok]) for j, tok in enumerate(sample.response_ids)], abs=1e-4
    )
    # The student as its own teacher: every log-ratio, hence the estimate, is 0.
    assert own.token_scores[OPD_REVERSE_KL] == pytest.approx([0.0] * len(own.response_ids), abs=1e-5)


# ------------------------------------------------------------------ tokenizer check


def word_tokenizer(vocab: dict[str, int], unk: str = "w0", bos: str | None = None):
    """A word-level tokenizer over ``vocab``; ``bos``: a word its post-processor puts in front of every
    text (an ordinary vocabulary entry, not an added token, so it never splits other words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk)


@pytest.mark.slow
def test_the_tokenizer_check_passes_for_the_same_tokenizer_and_names_the_first_difference(
    engines: dict[str, str],
) -> None:
    from transformers import AutoTokenizer

    same = AutoTokenizer.from_pretrained(engines["student_dir"])
    scorer = ServedTeacher({"default": engines["teacher"], "b": engines["student"]})

    async def check_all() -> None:
        await scorer.check_tokenizer(same)
        await scorer.aclose()

    asyncio.run(check_all())
    # The same words with BOS ("w1") added in front of every text: engines that add none still pass.
    with_bos = word_tokenizer({f"w{i}": i for i in range(VOCAB)}, bos="w1")
    assert with_bos.encode("w5 w6") == [1, 5, 6]
    asyncio.run(check_same_tokenizer(engines["teacher"], with_bos))
    # Another vocabulary (word i has id i + 1): unknown words already differ at the first token.
    shifted = word_tokenizer({f"w{i}": (i + 1) % VOCAB for i in range(VOCAB)})
    with pytest.raises(EngineError, match="first difference is at token 0 \\(engine: 0, student: 1") as info:
        asyncio.run(check_same_tokenizer(engines["teacher"], shifted))
    assert engines["teacher"] in str(info.value) and "must use the same tokenizer" in str(info.value)
    # Only one word swapped (w7 <-> w8): the vocabulary sample in the probe exposes it.
    swapped = {f"w{i}": i for i in range(VOCAB)} | {"w7": 8, "w8": 7}
    with pytest.raises(EngineError, match="first difference is at token"):
        asyncio.run(check_same_tokenizer(engines["teacher"], word_tokenizer(swapped)))
