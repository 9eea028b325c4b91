"""The embedded engine's /generate: batching, logprobs, stopping, abort and pause, through the real client."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.helpers import full_forward_logprobs, greedy_local, load_local, make_tiny_qwen3, running_engine
from miles.engines.client import SGLangClient, SyncEngineClient, parse_generate_response
from miles.errors import EngineError
from miles.types import SamplingParams

# One engine process per module (~10 s to start on CPU).
pytestmark = pytest.mark.slow

EOS_PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def model_dir(engine_tmp: Path) -> Path:
    """Seed-0 tiny Qwen3 whose EOS is a later greedy token after EOS_PROMPT (so EOS is reachable)."""
    from transformers import GenerationConfig

    path = make_tiny_qwen3(engine_tmp / "generate-model", seed=0, tokenizer=True)
    greedy = greedy_local(load_local(path), EOS_PROMPT, 8)
    k = max(i for i in range(1, 6) if greedy[i] not in greedy[:i])
    GenerationConfig(eos_token_id=greedy[k]).save_pretrained(path)
    (path / "eos.txt").write_text(f"{greedy[k]} {k}")
    return path


@pytest.fixture(scope="module")
def local_model(model_dir: Path):
    return load_local(model_dir)


@pytest.fixture(scope="module")
def url(model_dir: Path, engine_tmp: Path):
    with running_engine(model_dir, engine_tmp / "logs-generate", max_batch_size=16) as u:
        yield u


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60, trust_env=False)


def server_info(url: str) -> dict:
    return SyncEngineClient(url).get_server_info()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_are_batched_and_logprobs_match_a_full_forward(url: str, local_model) -> None:
    client = SGLangClient(url)
    prompts = [
        [1 + i, 2 + i, 3] + [4] * (i % 5) for i in range(12)
    ]  # different lengths: padding is exercised
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=40)
    before = server_info(url)["batch_stats"]

    async def all_at_once():
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    outs = run(all_at_once())
    stats = server_info(url)["batch_stats"]
    assert stats["max_decode_batch"] > 1
    rows = stats["decode_rows"] - before["decode_rows"]
    steps = stats["decode_steps"] - before["decode_steps"]
    assert rows / steps > 1.5, "concurrent requests should share decode steps"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason in ("length", "stop")
        assert 1 <= len(out.output_ids) <= 12 and len(out.output_logprobs) == len(out.output_ids)
        assert out.weight_version == 0 and out.prompt_tokens == len(prompt)
        expected = full_forward_logprobs(local_model, prompt, out.output_ids, 0.7)
        assert out.output_logprobs == pytest.approx(expected, abs=1e-4)
        # The tokenizer in the model directory renders the text (word-level: token i is "w{i}"; w0 is its
        # special unknown token, skipped like SGLang's skip_special_tokens default).
        assert out.text.split() == [f"w{t}" for t in out.output_ids if t != 0]


def test_seeded_sampling_is_deterministic_even_inside_a_batch(url: str) -> None:
    client = SGLangClient(url)
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1234)
    alone = run(client.generate([9, 8, 7], seeded))

    async def crowded():
        noise = [client.generate([i, i + 1], SamplingParams(max_new_tokens=10)) for i in range(6)]
        return (await asyncio.gather(client.generate([9, 8, 7], seeded), *noise))[0]

    again = run(crowded())
    assert again.output_ids == alone.output_ids
    assert again.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    other = run(client.generate([9, 8, 7], SamplingParams(max_new_tokens=10, temperature=1.0, seed=99)))
    assert other.output_ids != alone.output_ids


def test_greedy_stops_on_the_models_eos_and_on_stop_token_ids(url: str, model_dir: Path, local_model) -> None:
    eos, k = (int(x) for x in (model_dir / "eos.txt").read_text().split())
    client = SyncEngineClient(url)
    out = client.generate(EOS_PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0))
    greedy = greedy_local(local_model, EOS_PROMPT, 8)
    assert out.finish_reason == "stop"
    assert out.output_ids == greedy[: k + 1] and out.output_ids[-1] == eos  # the stop token is included
    assert out.output_logprobs == pytest.approx(
        full_forward_logprobs(local_model, EOS_PROMPT, out.output_ids, 0.0), abs=1e-4
    )
    # ignore_eos runs to the length limit; an explicit stop id stops at its first occurrence.
    body = {
        "input_ids": EOS_PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    data = post(url, body).json()
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert data["output_ids"] == greedy
    stop = greedy[1]
    first = greedy.index(stop)
    body["sampling_params"]["stop_token_ids"] = [stop]
    data = post(url, body).json()
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert data["output_ids"] == greedy[: first + 1]


def test_length_limit_and_zero_tokens(url: str) -> None:
    body = {
        "input_ids": [3, 4],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 1},
    }
    data = post(url, body).json()
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(data["output_ids"]) == 5 and len(data["meta_info"]["output_token_logprobs"]) == 5
    assert all(t[2] is None for t in data["meta_info"]["output_token_logprobs"])
    body["sampling_params"]["max_new_tokens"] = 0
    data = post(url, body).json()
    assert data["output_ids"] == [] and data["meta_info"]["finish_reason"]["type"] == "length"


def _long_request(
    url: str, rid: str, results: dict, seed: int = 7, max_new_tokens: int = 400
) -> threading.Thread:
    body = {
        "input_ids": [1, 2, 3],
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling_seed": seed},
    }

    def go() -> None:
        results[rid] = post(url, body).json()

    t = threading.Thread(target=go)
    t.start()
    return t


def _wait_running(url: str, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while server_info(url)["num_running"] < n:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


def test_abort_request_returns_the_partial_output(url: str) -> None:
    results: dict = {}
    t = _long_request(url, "to-abort", results, max_new_tokens=480)
    _wait_running(url)
    # Hold the request mid-flight so the abort cannot lose a race with a fast machine.
    run(SGLangClient(url).pause_generation(mode="in_place"))
    try:
        run(SGLangClient(url).abort_request("to-abort"))
    finally:
        run(SGLangClient(url).continue_generation())
    t.join(timeout=30)
    meta = results["to-abort"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(results["to-abort"]["output_ids"]) < 480
    assert len(meta["output_token_logprobs"]) == len(results["to-abort"]["output_ids"])


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_requests_and_continue_finishes_them_unchanged(url: str, mode: str) -> None:
    reference: dict = {}
    _long_request(url, f"ref-{mode}", reference, max_new_tokens=300).join(timeout=60)
    client = SyncEngineClient(url)
    results: dict = {}
    t = _long_request(url, mode, results, max_new_tokens=300)
    _wait_running(url)
    client.pause_generation(mode)
    info = server_info(url)
    assert info["paused"] and info["pause_mode"] == mode
    steps = info["batch_stats"]["decode_steps"]
    late: dict = {}
    t_late = _long_request(url, f"late-{mode}", late, max_new_tokens=5)  # arrives while paused: waits
    time.sleep(0.3)
    info = server_info(url)
    assert info["batch_stats"]["decode_steps"] == steps, "no forward pass may run while paused"
    assert info["num_waiting"] >= 1 and mode not in results and f"late-{mode}" not in late
    client.continue_generation()
    t.join(timeout=60)
    t_late.join(timeout=60)
    out, ref = results[mode], reference[f"ref-{mode}"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == ref["output_ids"]  # same seed, same weights: pausing changes nothing
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([x[0] for x in ref["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert late[f"late-{mode}"]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_mode_aborts_in_flight_and_later_requests_wait(url: str) -> None:
    client = SyncEngineClient(url)
    results: dict = {}
    t = _long_request(url, "doomed", results, max_new_tokens=480)
    _wait_running(url)
    client.pause_generation("abort")
    t.join(timeout=30)
    assert results["doomed"]["meta_info"]["finish_reason"]["type"] == "abort"
    late: dict = {}
    t_late = _long_request(url, "after-pause", late, max_new_tokens=4)
    time.sleep(0.2)
    assert "after-pause" not in late
    client.continue_generation()
    t_late.join(timeout=30)
    assert late["after-pause"]["meta_info"]["finish_reason"]["type"] == "length"
    assert not server_info(url)["paused"]


def test_bad_requests_are_refused_with_a_clear_message(url: str) -> None:
    cases = [
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_tokens": 3}}, "min_tokens"),
        ({"input_ids": [1, 500]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1], "stream": True}, "streaming"),
        ({"input_ids": [1], "return_routed_experts": True}, "no MoE"),
        ({"input_ids": [1], "text": "w1"}, "exactly one of input_ids and text"),
    ]
    for body, needle in cases:
        r = post(url, body)
        assert r.status_code == 400, body
        assert needle in r.json()["message"], (body, r.json())
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*outside the vocabulary") as info:
        SyncEngineClient(url).generate([1, 999], SamplingParams(max_new_tokens=2))
    assert url in str(info.value)
    r = httpx.post(url + "/pause_generation", json={"mode": "sideways"}, trust_env=False)
    assert r.status_code == 400 and r.json()["success"] is False and "mode" in r.json()["message"]


def test_status_endpoints(url: str) -> None:
    client = SyncEngineClient(url)
    assert client.health()
    assert client.weight_version() == 0
    info = client.get_model_info()
    assert info["is_generation"] and info["vocab_size"] == 128 and info["moe"] is None
    assert client.get_server_info()["continuous_batching"] is True
    client.flush_cache()  # no cache across requests: accepted, nothing to drop
    client.update_weight_version(4)
    assert client.weight_version() == 4
    out = client.generate([1, 2], SamplingParams(max_new_tokens=1))
    assert out.weight_version == 4
    client.update_weight_version(0)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_request_spanning_a_weight_update_reports_each_tokens_version(url: str, mode: str) -> None:
    client = SyncEngineClient(url)
    start = client.weight_version()
    results: dict = {}
    t = _long_request(url, f"span-{mode}", results, max_new_tokens=300)
    _wait_running(url)
    client.pause_generation(mode)
    try:
        client.update_weight_version(start + 1)
    finally:
        client.continue_generation()
    t.join(timeout=60)
    out = results[f"span-{mode}"]
    versions = out["meta_info"]["output_token_weight_versions"]
    assert len(versions) == len(out["output_ids"]) == 300
    assert versions == sorted(versions), "versions must not go back in time within a request"
    assert versions[0] == start and versions[-1] == start + 1, versions[:3] + versions[-3:]
    assert out["meta_info"]["weight_version"] == str(start + 1)
    # The client keeps the per-token versions, so staleness is measured from the oldest token.
    parsed = parse_generate_response(out, prompt_len=3)
    assert parsed.token_versions() == versions


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(url: str) -> None:
    # 5e-324 is 0.0 in float32: a naive nucleus cut would drop every token and sample from NaNs.
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4, "top_p": 5e-324, "ignore_eos": True},
    }
    out = post(url, body).json()
    assert len(out["output_ids"]) == 4
    greedy = post(url, {**body, "sampling_params": {**body["sampling_params"], "temperature": 0.0}}).json()
    assert out["output_ids"] == greedy["output_ids"]
    # Likewise a temperature too small for float32 logits is greedy, not a division by zero.
    tiny = post(
        url, {**body, "sampling_params": {**body["sampling_params"], "top_p": 1.0, "temperature": 5e-324}}
    )
    assert tiny.json()["output_ids"] == greedy["output_ids"]
