"""Scoring on the embedded engine (SGLang's input log-probs), the client's ``score``, and its contract.

One engine process serves the whole module; expected log-probs come from a local
unpadded forward of the same checkpoint (``log_softmax(logits / T)``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from engine.helpers import load_local, running_engine
from engine.sglang_fake import FakeSGLang
from miles.engines.client import SGLangClient, SyncEngineClient, parse_score_response
from miles.errors import EngineError
from miles.types import SamplingParams

SEQ = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


@pytest.fixture(scope="module")
def url(dense_dir: Path, engine_tmp: Path):
    with running_engine(dense_dir, engine_tmp / "logs-scoring", max_batch_size=8) as u:
        yield u


@pytest.fixture(scope="module")
def local_model(dense_dir: Path):
    return load_local(dense_dir)


@pytest.fixture(scope="module")
def client(url: str):
    with SyncEngineClient(url) as c:
        yield c


def local_logp(model, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V]: row p is log π(· | ids[: p + 1]) at temperature T (T = 0 scores at 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def flat(rows: list[list[float]]) -> list[float]:
    """Nested rows as one list (pytest.approx compares flat sequences), with the row lengths kept apart."""
    return [x for row in rows for x in row]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60, trust_env=False)


def score_body(ids: list[int], start: int, **extra) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": extra.pop("temperature", 1.0)},
        "return_logprob": True,
        "logprob_start_len": start,
        **extra,
    }


# ----------------------------------------------------------------------- engine


@pytest.mark.slow
def test_scoring_reproduces_the_logprobs_reported_while_generating(url: str, local_model) -> None:
    client = SGLangClient(url)
    prompt = [7, 3, 9, 1]

    async def go():
        out = await client.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.7, seed=3))
        scored = await client.score(prompt + out.output_ids, start=len(prompt), temperature=0.7)
        greedy = await client.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
        greedy_scored = await client.score(prompt + greedy.output_ids, start=len(prompt), temperature=0.0)
        await client.aclose()
        return out, scored, greedy, greedy_scored

    out, scored, greedy, greedy_scored = asyncio.run(go())
    assert len(out.output_ids) == 10
    # The same engine, the same temperature: scoring the sampled tokens gives back their log-probs.
    assert scored.logprobs == pytest.approx(out.output_logprobs, abs=1e-5)
    assert scored.top_ids is None and scored.token_ids_logprobs is None
    # T = 0 (greedy) scores at T = 1, like the greedy log-probs the engine reports.
    assert greedy_scored.logprobs == pytest.approx(greedy.output_logprobs, abs=1e-5)
    logp = local_logp(local_model, prompt + greedy.output_ids, 1.0)
    expected = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(greedy.output_ids)]
    assert greedy_scored.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_logprob_start_len_follows_sglang(url: str, client: SyncEngineClient, local_model) -> None:
    logp = local_logp(local_model, SEQ, 0.5)
    n = len(SEQ)
    for start in (0, 1, 4, n - 1):
        data = post(url, score_body(SEQ, start, temperature=0.5)).json()
        meta = data["meta_info"]
        entries = meta["input_token_logprobs"]
        # One entry per input position start..n-1; the first has no log-prob (as in SGLang, whatever start is).
        assert [e[1] for e in entries] == SEQ[start:] and len(entries) == n - start
        assert entries[0][0] is None and all(e[2] is None for e in entries)
        expected = [float(logp[p - 1, SEQ[p]]) for p in range(start + 1, n)]
        assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-4)
        assert data["output_ids"] == [] and meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["prompt_tokens"] == n and meta["completion_tokens"] == 0
    # The client's start is the first scored token (it asks from start - 1 and drops the empty entry).
    for start in (1, 5, n):
        out = client.score(SEQ, start=start, temperature=0.5)
        assert out.logprobs == pytest.approx([float(logp[p - 1, SEQ[p]]) for p in range(start, n)], abs=1e-4)
    # Without logprob_start_len (SGLang's -1), the last input position alone is reported.
    data = post(
        url, {"input_ids": SEQ, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    ).json()
    assert data["meta_info"]["input_token_logprobs"] == [[None, SEQ[-1], None]]
    assert len(data["output_ids"]) == 2


@pytest.mark.slow
def test_top_k_and_requested_ids_in_both_forms(url: str, client: SyncEngineClient, local_model) -> None:
    start, k = 3, 5
    logp = local_logp(local_model, SEQ, 0.8)
    top = client.score(SEQ, start=start, temperature=0.8, top_k=k)
    assert len(top.top_ids) == len(top.top_logprobs) == len(SEQ) - start
    for j, (ids, lps) in enumerate(zip(top.top_ids, top.top_logprobs, strict=True)):
        row = logp[start - 1 + j]
        assert lps == sorted(lps, reverse=True)  # most likely first
        assert ids == torch.topk(row, k).indices.tolist()
        assert lps == pytest.approx(row[ids].tolist(), abs=1e-4)
    # Asking for the top ids per position (the embedded extension) returns the same log-probs.
    per_position = client.score(SEQ, start=start, temperature=0.8, token_ids=top.top_ids)
    assert flat(per_position.token_ids_logprobs) == pytest.approx(flat(top.top_logprobs), abs=1e-6)
    assert per_position.logprobs == pytest.approx(top.logprobs, abs=1e-6)
    # The flat form (SGLang's): the same ids at every position, in the order asked.
    same_ids = client.score(SEQ, start=start, temperature=0.8, token_ids=[9, 0, 127])
    for j, lps in enumerate(same_ids.token_ids_logprobs):
        assert lps == pytest.approx(logp[start - 1 + j, [9, 0, 127]].tolist(), abs=1e-4)
    # The raw answer: one list of [logprob, id, text] per position, null at the first.
    meta = post(
        url, score_body(SEQ, 2, top_logprobs_num=2, token_ids_logprob=[[], [4], [1, 5]] + [[0]] * 6)
    ).json()
    meta = meta["meta_info"]
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert [e[1] for e in meta["input_token_ids_logprobs"][2]] == [1, 5]
    assert len(meta["input_top_logprobs"]) == len(SEQ) - 2 and len(meta["input_top_logprobs"][1]) == 2


@pytest.mark.slow
def test_generation_reports_output_top_k_and_requested_ids(url: str, local_model) -> None:
    body = {
        "input_ids": [7, 3, 9],
        "return_logprob": True,
        "top_logprobs_num": 3,
        "token_ids_logprob": [2, 11],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.9, "sampling_seed": 5, "ignore_eos": True},
    }
    meta = post(url, body).json()["meta_info"]
    out = [e[1] for e in meta["output_token_logprobs"]]
    logp = local_logp(local_model, [7, 3, 9, *out], 0.9)
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == 4
    for j in range(4):
        row = logp[2 + j]
        assert [e[1] for e in meta["output_top_logprobs"][j]] == torch.topk(row, 3).indices.tolist()
        got = meta["output_token_ids_logprobs"][j]
        assert [e[1] for e in got] == [2, 11]
        assert [e[0] for e in got] == pytest.approx(row[[2, 11]].tolist(), abs=1e-4)
    assert meta["input_top_logprobs"] == [None] and meta["input_token_ids_logprobs"] == [None]


@pytest.mark.slow
def test_text_input_is_tokenized_by_the_engine(url: str, client: SyncEngineClient) -> None:
    # The word-level test tokenizer: token i is the word "w{i}".
    body = {
        "text": "w5 w17 w3 w99",
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 0},
    }
    meta = post(url, body).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 17, 3, 99]
    assert [e[2] for e in meta["input_token_logprobs"]] == ["w5", "w17", "w3", "w99"]
    scored = client.score([5, 17, 3, 99], start=1)
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(scored.logprobs, abs=1e-6)


@pytest.mark.slow
def test_scoring_and_generation_share_the_scheduler(url: str, client: SyncEngineClient) -> None:
    sampler = SGLangClient(url)
    before = client.get_server_info()["batch_stats"]
    alone = client.generate([9, 8, 7], SamplingParams(max_new_tokens=12, temperature=1.0, seed=21))

    async def crowd():
        gens = [sampler.generate([9, 8, 7], SamplingParams(max_new_tokens=12, temperature=1.0, seed=21))]
        scores = [sampler.score(SEQ[: 4 + i], start=2, temperature=0.6, top_k=2) for i in range(6)]
        results = await asyncio.gather(*gens, *scores)
        await sampler.aclose()
        return results

    results = asyncio.run(crowd())
    # A generation batched with scoring requests is unchanged; every scoring call equals its solo answer.
    assert results[0].output_ids == alone.output_ids
    assert results[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    for i, scored in enumerate(results[1:]):
        solo = client.score(SEQ[: 4 + i], start=2, temperature=0.6, top_k=2)
        assert scored.logprobs == pytest.approx(solo.logprobs, abs=1e-5)
        assert scored.top_ids == solo.top_ids
    stats = client.get_server_info()["batch_stats"]
    assert stats["scoring_requests"] - before["scoring_requests"] >= 12
    assert stats["input_positions_scored"] > before["input_positions_scored"]


@pytest.mark.slow
def test_bad_scoring_requests_are_refused_with_a_clear_message(url: str, client: SyncEngineClient) -> None:
    n = len(SEQ)
    cases = [
        (score_body(SEQ, n), f"logprob_start_len {n} is beyond the input"),
        (score_body(SEQ, -2), "logprob_start_len"),
        (score_body(SEQ, 0, top_logprobs_num=-1), "top_logprobs_num must be 0"),
        (score_body(SEQ, 0, top_logprobs_num=500), "exceeds the vocabulary size 128"),
        (score_body(SEQ, 0, token_ids_logprob=[1, 500]), "token_ids_logprob holds token ids outside"),
        (score_body(SEQ, 0, token_ids_logprob=[]), "token_ids_logprob is empty"),
        (score_body(SEQ, 8, token_ids_logprob=[[1]] * 2), "need 3"),
        (
            {**score_body(SEQ, 8, token_ids_logprob=[[1]] * 3), "sampling_params": {"max_new_tokens": 1}},
            "max_new_tokens to 0",
        ),
        ({**score_body(SEQ, 0), "text": "w1 w2"}, "exactly one of input_ids and text"),
        ({"return_logprob": True}, "exactly one of input_ids and text"),
        ({"text": "   "}, "no tokens"),
    ]
    for body, needle in cases:
        r = post(url, body)
        assert r.status_code == 400, body
        assert needle in r.json()["message"], (body, r.json())
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*token ids outside the vocabulary") as info:
        client.score([1, 2, 999], start=1)
    assert url in str(info.value)
    with pytest.raises(EngineError, match=r"start 0 is outside 1\.\.3"):
        client.score([1, 2, 3], start=0)
    with pytest.raises(EngineError, match="top_k must be >= 0"):
        client.score([1, 2, 3], start=1, top_k=-1)


# ----------------------------------------------------- chunked prefill (in-process)


def test_a_prefill_over_the_logits_budget_runs_in_chunks_with_the_same_results(local_model) -> None:
    from miles.engines.embedded.sampler import GenRequest, Runner

    def rows() -> list[GenRequest]:
        # Different lengths (left padding), starts, forms, and one row that only generates.
        return [
            GenRequest("a", list(SEQ), 0, temperature=0.7, logprob_start=0, top_logprobs_num=3),
            GenRequest("b", SEQ[:6], 0, temperature=1.0, logprob_start=2, token_ids_logprob=[4, 8]),
            GenRequest(
                "c",
                SEQ[:5],
                0,
                temperature=0.0,
                logprob_start=1,
                token_ids_per_position=[[], [1], [2, 3], [5]],
            ),
            GenRequest("d", [1, 2], 3, temperature=0.0),
        ]

    runner = Runner(local_model, torch.device("cpu"), max_context=512, recorder=None, seed=0)
    whole = rows()
    runner.prefill(whole)
    runner.logits_budget = 4 * 128 * 3  # 4 rows x 128 vocab x 3 columns per forward
    assert len(runner._spans(4, len(SEQ), len(SEQ))) == 4  # the 11 kept columns, 3 at a time
    chunked = rows()
    runner.prefill(chunked)
    for a, b in zip(whole, chunked, strict=True):
        assert b.input_logprobs == pytest.approx(a.input_logprobs, abs=1e-5)
        assert [t[1] for t in b.input_top] == [t[1] for t in a.input_top]
        assert [len(r) for r in b.input_ids_logprobs] == [len(r) for r in a.input_ids_logprobs]
        assert flat(b.input_ids_logprobs) == pytest.approx(flat(a.input_ids_logprobs), abs=1e-5)
        assert b.input_scored == (b.logprob_start is not None) and b.output_ids == a.output_ids
    a, b, c, d = chunked
    assert len(a.input_logprobs) == len(SEQ) - 1 and len(a.input_top) == len(SEQ) - 1
    assert (
        len(b.input_logprobs) == 3
        and len(c.input_ids_logprobs) == 3
        and [len(x) for x in c.input_ids_logprobs] == [1, 2, 1]
    )
    # Scoring-only rows finish without sampling; the generating row got its first token.
    assert a.finish == {"type": "length", "length": 0} and a.output_ids == []
    assert d.finish is None and len(d.output_ids) == 1 and d.input_logprobs == []
    logp = local_logp(local_model, SEQ[:5], 0.0)
    assert c.input_logprobs == pytest.approx([float(logp[p - 1, SEQ[p]]) for p in (2, 3, 4)], abs=1e-4)
    assert c.input_ids_logprobs[1] == pytest.approx(logp[2, [2, 3]].tolist(), abs=1e-4)


# ------------------------------------------------------------ the client's contract


def test_score_request_fits_sglangs_api_and_parses_its_answer() -> None:
    with FakeSGLang() as fake:
        client = SyncEngineClient(fake.url)
        out = client.score([10, 11, 12, 13], start=2, temperature=0.7, top_k=2, token_ids=[4, 6])
    [(_, path, body)] = fake.requests
    assert path == "/generate"
    assert body == {
        "input_ids": [10, 11, 12, 13],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 2,
        "token_ids_logprob": [4, 6],
    }
    # The fake scores position p with -0.01·p and lists ids p, p+1 as its top 2 (see sglang_fake).
    assert out.logprobs == pytest.approx([-0.02, -0.03])
    assert out.top_ids == [[2, 3], [3, 4]] and flat(out.top_logprobs) == pytest.approx([-0.1, -0.2] * 2)
    assert flat(out.token_ids_logprobs) == pytest.approx([-0.2, -0.4] * 2)


def test_score_answers_that_do_not_match_the_request_are_refused() -> None:
    def answer(entries, **extra):
        return {
            "meta_info": {
                "finish_reason": {"type": "length", "length": 0},
                "input_token_logprobs": entries,
                **extra,
            }
        }

    ids, where = [5, 6, 7], "http://teacher:1"
    good = [[None, 5, None], [-0.5, 6, None], [-0.25, 7, None]]
    assert parse_score_response(answer(good[1:]), ids, start=2, url=where).logprobs == [-0.25]
    with pytest.raises(
        EngineError, match=r"http://teacher:1/generate \(score\): meta_info.input_token_logprobs has 2"
    ):
        parse_score_response(answer(good[1:]), ids, start=1, url=where)
    with pytest.raises(EngineError, match="names token 9 at position 2; the request sent 7"):
        parse_score_response(answer([*good[:2], [-0.1, 9, None]]), ids, start=1, url=where)
    with pytest.raises(EngineError, match="input_top_logprobs at position 1 has 1 entries, expected 2"):
        tops = [None, [[-0.1, 1, None]], [[-0.1, 1, None], [-0.2, 2, None]]]
        parse_score_response(answer(good, input_top_logprobs=tops), ids, start=1, top_k=2, url=where)
    with pytest.raises(EngineError, match=r"no meta_info\.input_token_ids_logprobs"):
        parse_score_response(answer(good), ids, start=1, token_ids=[1], url=where)
    with pytest.raises(EngineError, match="does not answer the ids asked for"):
        asked = [None, [[-0.1, 1, None]], [[-0.1, 2, None]]]
        parse_score_response(
            answer(good, input_token_ids_logprobs=asked), ids, start=1, token_ids=[1], url=where
        )
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "paused"}}}
    with pytest.raises(EngineError, match="scoring was aborted: paused"):
        parse_score_response(aborted, ids, start=1, url=where)
