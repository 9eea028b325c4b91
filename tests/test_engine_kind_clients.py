"""Every path that talks to engines uses the selected engine kind's own client.

The engine kind is the example plugin's ``echo`` (tests/plugins/miles-example-plugin): an
in-process engine with its own client, speaking no HTTP, so a path that still built the
SGLang client would fail to reach it. Each test runs the path for real (an evaluation, a
served teacher's tokenizer check and scoring, the data-parallel query, a session server
turn) and checks that the kind's client served it.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine.helpers import make_tiny_qwen3
from eval.helpers import PROBE, make_config, pause_production, write_eval_data

from miles.config.schema import MilesConfig

pytestmark = pytest.mark.usefixtures("fixture_plugins")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("echo-model") / "model", seed=0, tokenizer=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _echo() -> Any:
    import miles_example_plugin.engine as echo

    return echo


def _clients_of(url: str) -> list[Any]:
    return [c for c in _echo().CLIENTS if c.url == url]


def _echo_config(tmp_path: Path, model_dir: Path, **sections: Any) -> MilesConfig:
    from miles.config.loader import plugin_config_model  # plugin sections (agentic:) included

    data = write_eval_data(tmp_path / "data.jsonl")
    return plugin_config_model().model_validate(
        {
            "run": {"output_dir": str(tmp_path)},
            "model": {"path": str(model_dir)},
            "data": {"path": str(data)},
            "engine": {"launcher": "echo"},
            **sections,
        }
    )


def test_shared_evaluation_samples_through_the_kinds_client(
    tmp_path: Path, model_dir: Path, tokenizer
) -> None:
    from miles.eval import Evaluator

    url = "echo://eval-shared"
    _echo().VERSIONS[url] = 3  # the driver just pushed the weights of step 2
    PROBE.reset()
    config = make_config(tmp_path, model_dir, write_eval_data(tmp_path / "eval.jsonl"), mode="shared")
    config.engine.launcher = "echo"
    evaluator = Evaluator(
        config,
        model_path=str(model_dir),
        tokenizer=tokenizer,
        run_dir=str(tmp_path / "run"),
        engine_urls=[url],
        export_snapshot=lambda directory: None,
        pause_production=pause_production,
        weights_lock=threading.Lock(),
    )
    with evaluator as ev:
        ev.start(2)
        [result] = ev.collect(2)
    assert (result.status, result.weight_version) == ("ok", 3), result
    [client] = _clients_of(url)
    assert type(client).__name__ == "EchoClient"
    assert client.calls.count("generate") == len(PROBE.calls) > 0  # every eval sample came from it
    assert "aclose" in client.calls


def test_served_teacher_is_an_engine_of_the_kind(tmp_path: Path, model_dir: Path, tokenizer) -> None:
    from miles.driver.services import served_teacher
    from miles.interfaces import TEACHER_LOGPROBS, RolloutContext
    from miles.types import Prompt, Sample, SamplingParams

    config = _echo_config(
        tmp_path,
        model_dir,
        distillation={"teacher": "served", "teachers": {"default": {"model": str(model_dir)}}},
    )
    loop = asyncio.new_event_loop()
    try:
        with served_teacher(config, tokenizer, loop, str(tmp_path / "teachers")) as teacher:
            [client] = teacher.teachers.values()
            assert type(client).__name__ == "EchoClient"
            # The tokenizer check ran through the kind's client (it tokenizes like the student).
            assert "tokenize" in client.calls
            sample = Sample(prompt=Prompt(index=0, prompt="w1"), prompt_ids=[5, 6], response_ids=[7, 8, 9])
            ctx = RolloutContext(
                engines=[], tokenizer=tokenizer, sampling=SamplingParams(), n_samples_per_prompt=1, reward=len
            )
            loop.run_until_complete(teacher(ctx, sample))
        assert sample.token_scores[TEACHER_LOGPROBS] == [-1.0, -1.0, -1.0]
        assert "score" in client.calls and "aclose" in client.calls
    finally:
        loop.close()


def test_data_parallel_sizes_are_asked_through_the_kinds_client(tmp_path: Path, model_dir: Path) -> None:
    from miles.driver.rollout_services import fleet_dp_sizes

    url = "echo://dp"
    assert fleet_dp_sizes([url], _echo_config(tmp_path, model_dir)) == [1]
    [client] = _clients_of(url)
    assert client.calls == ["get_server_info", "aclose"]


def test_session_server_turns_run_on_the_kinds_client(tmp_path: Path, model_dir: Path, tokenizer) -> None:
    from miles.types import SamplingParams
    from miles_envs.service import resolve_agentic, session_server

    url = "echo://sessions"
    config = _echo_config(
        tmp_path,
        model_dir,
        rollout={"generate_fn": "agentic", "max_new_tokens": 2},
        agentic={"family": "generic"},
    )
    agentic = resolve_agentic(config)
    chat = copy.deepcopy(tokenizer)  # the generic family renders with the tokenizer's own template
    chat.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    chat.eos_token = chat.eos_token or "w0"
    with session_server(config, agentic, [url], chat, SamplingParams(max_new_tokens=2)) as ctx:
        assert ctx is not None and ctx.server is not None
        server = ctx.server
        assert [type(e).__name__ for e in server.state.engines] == ["EchoClient"]
        _, base_url = server.open()
        reply = httpx.post(
            f"{base_url}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "w1 w2"}]},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    [client] = _clients_of(url)
    assert client.calls.count("generate") == 1
