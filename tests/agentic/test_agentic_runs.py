"""`miles run` end to end with multi-turn and agentic rollouts: a real engine serving the trained
calculator model, the real session server, an FSDP rank training on the episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentic.scripted_model import PAIRS, script_episode
from miles import hookimpl
from miles.config import load_recipe
from miles.loop import train
from miles.plugins import get_plugin_manager

pytestmark = pytest.mark.slow


class _Trained:
    """The samples each step trained on."""

    def __init__(self) -> None:
        self.samples: dict[int, list] = {}

    @hookimpl
    def miles_advantages_postprocess(self, batch):
        self.samples[batch.step] = list(batch.samples)


def _run(config) -> tuple[object, _Trained]:
    rec = _Trained()
    pm = get_plugin_manager()
    pm.register(rec)
    try:
        return train(config), rec
    finally:
        pm.unregister(rec)


def _recipe(tmp_path: Path, model_dir: Path, *overrides: str):
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {a}+{b}?", "label": str(a + b)}) + "\n" for a, b in PAIRS)
    )
    return load_recipe(
        "default",
        [
            f"run.output_dir={tmp_path}",
            "warm_start=null",
            "eval=null",
            # The RL settings these tests were written for (the default recipe's before its warm start).
            "rollout.reward=numeric_closeness",
            "train.lr=0.01",
            "run.num_steps=2",
            f"model.path={model_dir}",
            f"data.path={data}",
            "data.shuffle=false",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=40",
            "rollout.reward=exact_match",
            "rollout.filters=[]",
            "train.lr=1e-6",
            "tracking.console=false",
            "weight_sync.check_equal=true",
            *overrides,
        ],
    )


def _pair(sample) -> tuple[int, int]:
    text = (
        sample.prompt.prompt if isinstance(sample.prompt.prompt, str) else sample.prompt.prompt[-1]["content"]
    )
    a, b = text.removeprefix("What is ").removesuffix("?").split("+")
    return int(a), int(b)


def _assert_token_exact(rec: _Trained, family, tokenizer) -> None:
    assert sorted(rec.samples) == [0, 1]
    for step, samples in rec.samples.items():
        assert len(samples) == 4, step
        for sample in samples:
            script = script_episode(family, tokenizer, *_pair(sample))
            assert sample.response_ids == [*script.reply1, *script.suffix, *script.reply2]
            assert sample.loss_mask == [1] * len(script.reply1) + [0] * len(script.suffix) + [1] * len(
                script.reply2
            )
            assert sample.status.value == "completed" and sample.reward == 1.0


@pytest.mark.extended
def test_multi_turn_run_trains_on_the_episodes(tool_model, tmp_path) -> None:
    family, tokenizer, model_dir = tool_model
    config = _recipe(
        tmp_path,
        model_dir,
        "rollout.generate_fn=multi_turn",
        "agentic={family: qwen3, tools: calculator, max_turns: 4}",
        f"eval={{data: {{path: {tmp_path / 'sums.jsonl'}}}, max_prompts: 3, every: 2}}",
    )
    result, rec = _run(config)
    _assert_token_exact(rec, family, tokenizer)
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollout/reward_mean"] == 1.0 for r in rows)
    for row in rows:  # two turns, one tool call; turn 2 is served from turn 1's cached prefix
        assert row["rollout/episode/turns_mean"] == 2.0 and row["rollout/episode/tool_calls_mean"] == 1.0
        assert row["rollout/episode/cached_prompt_frac"] > 0.4
    # Evaluation runs the same multi-turn episodes (on the shared engines here).
    (evaluation,) = [json.loads(line) for line in Path(result.run_dir, "eval.jsonl").read_text().splitlines()]
    assert evaluation["status"] == "ok" and evaluation["metrics"]["score"] == 1.0, evaluation


def test_agentic_run_through_the_session_server_with_the_builtin_agent(tool_model, tmp_path) -> None:
    family, tokenizer, model_dir = tool_model
    config = _recipe(
        tmp_path,
        model_dir,
        "rollout.generate_fn=agentic",
        "agentic={family: qwen3, tools: calculator, agent: tool_agent, max_turns: 4}",
        "schedule=fully_async",
        "fully_async.max_staleness=4",
    )
    _, rec = _run(config)
    _assert_token_exact(rec, family, tokenizer)
    for samples in rec.samples.values():
        for sample in samples:
            assert sample.metadata["agent_turns"] == 2 and sample.metadata["agent_tool_calls"] == 1
            assert sample.metadata["session_mode"] == "linear"
