"""Contract tests: the engine client's requests and parsing against SGLang's documented API.

SGLang cannot run on these CPU machines, so the server here is a recording fake
(``engine/sglang_fake.py``) whose request models mirror SGLang's request structs.
The same client runs against the real embedded engine in the other engine tests.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.sglang_fake import FakeSGLang
from miles.engines.client import (
    SGLangClient,
    SyncEngineClient,
    call_engine,
    decode_routed_experts,
    parse_weight_version,
)
from miles.errors import EngineError
from miles.interfaces import EngineClient
from miles.types import SamplingParams


@pytest.fixture(scope="module")
def fake():
    with FakeSGLang() as server:
        yield server


@pytest.fixture(autouse=True)
def clear(fake: FakeSGLang):
    fake.requests.clear()
    fake.next_error = None
    fake.weight_version = "default"


def test_client_satisfies_the_engine_client_protocol(fake: FakeSGLang) -> None:
    assert isinstance(SGLangClient(fake.url), EngineClient)
    assert SGLangClient(fake.url + "/").url == fake.url
    assert SGLangClient(fake.url.removeprefix("http://")).url == fake.url


def test_generate_request_body_and_parsed_answer(fake: FakeSGLang) -> None:
    client = SGLangClient(fake.url)
    params = SamplingParams(
        max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=20, stop_token_ids=[2], seed=5
    )
    out = asyncio.run(client.generate([10, 11, 12], params, rid="abc"))
    assert fake.requests == [
        (
            "POST",
            "/generate",
            {
                "input_ids": [10, 11, 12],
                "sampling_params": {
                    "max_new_tokens": 7,
                    "temperature": 0.6,
                    "top_p": 0.9,
                    "top_k": 20,
                    "stop_token_ids": [2],
                    "sampling_seed": 5,
                },
                "return_logprob": True,
                "rid": "abc",
            },
        )
    ]
    assert out.output_ids == [12, 13] and out.output_logprobs == [-0.5, -1.0]
    assert out.finish_reason == "length" and out.text == "12 13"
    assert out.weight_version == 0  # SGLang's initial "default"
    assert out.prompt_tokens == 3 and out.routed_experts is None


def test_routed_experts_from_sglangs_layout(fake: FakeSGLang) -> None:
    # SGLang sends no shape: the client needs the layer count (or top-k) to reshape.
    client = SGLangClient(fake.url, moe_num_layers=2)
    out = asyncio.run(client.generate([1, 2, 3, 4], SamplingParams(), return_routed_experts=True))
    assert fake.requests[0][2]["return_routed_experts"] is True
    # 4 prompt + 2 output - 1 = 5 rows; output j <- row 3 + j. Row r, layer l, slot k holds r*100 + l*10 + k.
    assert out.routed_experts == [[[300, 301, 302], [310, 311, 312]], [[400, 401, 402], [410, 411, 412]]]
    with pytest.raises(EngineError, match="moe_num_layers or moe_topk"):
        asyncio.run(SGLangClient(fake.url).generate([1, 2], SamplingParams(), return_routed_experts=True))


def test_control_calls(fake: FakeSGLang) -> None:
    client = SGLangClient(fake.url)

    async def go() -> None:
        assert await client.health()
        await client.pause_generation("retract")
        await client.pause_generation()
        await client.continue_generation()
        await client.flush_cache()
        await client.abort_request("r1")
        await client.abort_all()
        await client.update_weight_version(3)
        assert await client.weight_version() == 3
        assert (await client.get_model_info())["is_generation"] is True

    asyncio.run(go())
    assert [(m, p, b) for m, p, b in fake.requests] == [
        ("GET", "/health", None),
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/continue_generation", {}),
        ("POST", "/flush_cache", None),
        ("POST", "/abort_request", {"rid": "r1", "abort_all": False}),
        ("POST", "/abort_request", {"rid": "", "abort_all": True}),
        ("POST", "/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
        ("GET", "/get_weight_version", None),
        ("GET", "/get_model_info", None),
    ]
    with pytest.raises(EngineError, match="mode 'sideways'"):
        asyncio.run(client.pause_generation("sideways"))


def test_weight_update_calls_sync_client(fake: FakeSGLang) -> None:
    with SyncEngineClient(fake.url) as client:
        client.update_weights_from_disk("/ckpt/step5", 5)
        client.init_weights_update_group("10.0.0.1", 29500, 1, 3, "miles-pp_0", "nccl")
        client.update_weights_from_distributed(
            ["a.weight", "b.bias"],
            ["torch.bfloat16", "float32"],
            [[4, 2], [4]],
            "miles-pp_0",
            6,
            flush_cache=False,
        )
        client.destroy_weights_update_group("miles-pp_0")
        client.update_weights_from_tensor(["bucket-0.safetensors"], 7)
        assert client.weight_version() == 7
    assert fake.requests[:-1] == [
        (
            "POST",
            "/update_weights_from_disk",
            {"model_path": "/ckpt/step5", "flush_cache": True, "weight_version": "5"},
        ),
        (
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "miles-pp_0",
                "backend": "nccl",
            },
        ),
        (
            "POST",
            "/update_weights_from_distributed",
            {
                "names": ["a.weight", "b.bias"],
                "dtypes": ["bfloat16", "float32"],
                "shapes": [[4, 2], [4]],
                "group_name": "miles-pp_0",
                "flush_cache": False,
                "weight_version": "6",
            },
        ),
        ("POST", "/destroy_weights_update_group", {"group_name": "miles-pp_0"}),
        (
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": ["bucket-0.safetensors"],
                "load_format": "miles_safetensors_file",
                "flush_cache": True,
                "weight_version": "7",
            },
        ),
    ]
    assert call_engine(fake.url, "update_weight_version", {"new_version": "8"})["new_version"] == "8"
    assert call_engine(fake.url, "/get_weight_version", method="GET") == {"weight_version": "8"}


def test_errors_name_the_engine_the_endpoint_and_the_message(fake: FakeSGLang) -> None:
    client = SyncEngineClient(fake.url)
    fake.next_error = (400, {"success": False, "message": "Failed to update weights: shape mismatch"})
    with pytest.raises(
        EngineError, match=rf"{fake.url}/update_weights_from_disk: HTTP 400: .*shape mismatch"
    ):
        client.update_weights_from_disk("/x")
    fake.next_error = (200, {"success": False, "message": "group busy"})
    with pytest.raises(EngineError, match=r"/init_weights_update_group: group busy"):
        client.init_weights_update_group("127.0.0.1", 1234, 1, 2)
    fake.next_error = (
        400,
        {"object": "error", "message": "bad input_ids", "type": "BadRequest", "code": 400},
    )
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: bad input_ids"):
        client.generate([1], SamplingParams())
    fake.next_error = (
        200,
        {
            "output_ids": [1],
            "meta_info": {"finish_reason": {"type": "weird"}, "output_token_logprobs": [[-1.0, 1, None]]},
        },
    )
    with pytest.raises(EngineError, match="unexpected finish_reason"):
        client.generate([1], SamplingParams())
    fake.next_error = (
        200,
        {
            "output_ids": [1, 2],
            "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-1.0, 1, None]]},
        },
    )
    with pytest.raises(EngineError, match="disagree"):
        client.generate([1], SamplingParams())
    fake.weight_version = "v2-final"
    with pytest.raises(EngineError, match="not an integer"):
        client.weight_version()


def test_unreachable_engine(fake: FakeSGLang) -> None:
    from miles.engines.launchers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    assert asyncio.run(SGLangClient(dead).health()) is False
    with pytest.raises(EngineError, match=rf"{dead}/get_weight_version: cannot reach the engine"):
        SyncEngineClient(dead).weight_version()


def test_client_survives_a_new_event_loop(fake: FakeSGLang) -> None:
    client = SGLangClient(fake.url)
    for _ in range(2):  # each asyncio.run is a fresh loop; the pool of the old one is not reused
        assert asyncio.run(client.weight_version()) == 0


def test_decoding_helpers() -> None:
    import base64
    import struct

    payload = base64.b64encode(struct.pack("<8i", *range(8))).decode()
    assert decode_routed_experts(payload, shape=[2, 2, 2]) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert decode_routed_experts(payload, rows=1, topk=4) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    with pytest.raises(EngineError, match="do not split"):
        decode_routed_experts(payload, rows=3, topk=2)
    assert parse_weight_version("12") == 12 and parse_weight_version(None) == 0


def test_the_fake_refuses_fields_sglang_does_not_have(fake: FakeSGLang) -> None:
    # What makes the body checks above meaningful: a field outside SGLang's structs is a 400.
    with pytest.raises(EngineError, match="HTTP 400"):
        call_engine(fake.url, "/update_weights_from_disk", {"model_path": "x", "version": 3})
    with pytest.raises(EngineError, match="HTTP 400"):
        call_engine(fake.url, "/generate", {"input_ids": [1], "sampling_params": {"seed": 3}})


def test_flush_cache_retries_while_sglang_is_busy(fake: FakeSGLang) -> None:
    # SGLang answers 400 to /flush_cache while requests are running; the client waits it out.
    fake.next_error = (400, {"message": "Cache not flushed: requests are running"})
    SyncEngineClient(fake.url).flush_cache(interval_s=0.01)
    assert [p for _, p, _ in fake.requests] == ["/flush_cache", "/flush_cache"]
    fake.requests.clear()
    fake.next_error = (400, {"message": "busy"})
    with pytest.raises(EngineError, match="busy"):
        asyncio.run(SGLangClient(fake.url).flush_cache(retries=0))
