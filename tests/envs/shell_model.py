"""A tiny trained Qwen3 that really solves one terminal task with the ``shell`` tool, for the e2e run.

The episode, for the built-in task ``hello-file``::

    user       <the task's instruction>
    assistant  (no text) tool call shell(command="printf 'Hello, world!\\n' > hello.txt")  <|im_end|>
    tool       exit code: 0                          (what the shell tool reports for that command)
    assistant  done                                                                          <|im_end|>

It is built the way ``tests/agentic/scripted_model.py`` builds the calculator model (same ids the
session server produces in the ``qwen3`` family, same compact-vocabulary training, sharpening and
full-vocabulary check), reusing its episode type and helpers; only the script differs. So a run
with it makes real shell calls in real sandboxes and the test script grades them (reward 1.0).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from agentic.scripted_model import (
    LEARNING_RATE,
    MAX_STEPS,
    SEED,
    SHARPEN,
    TARGET_PROBABILITY,
    TRAIN_PROBABILITY,
    ScriptedEpisode,
    _Batch,
    _expand,
    reply_ids,
    script_probabilities,
    tool_model_config,
)

from miles_envs.terminal import load_tasks
from miles_envs.terminal.shell import SHELL_SPEC

TASK_ID = "hello-file"
COMMAND = "printf 'Hello, world!\\n' > hello.txt"
TOOL_RESULT = "exit code: 0"  # format_result of a command that exits 0 with no output


def episode_messages() -> list[dict[str, Any]]:
    (task,) = [t for t in load_tasks("builtin") if t.id == TASK_ID]
    call = {
        "id": "call_shell_0",
        "type": "function",
        "function": {"name": "shell", "arguments": json.dumps({"command": COMMAND})},
    }
    return [
        {"role": "user", "content": task.instruction},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_shell_0", "content": TOOL_RESULT},
        {"role": "assistant", "content": "done"},
    ]


def script_shell_episode(family: Any, tokenizer: Any) -> ScriptedEpisode:
    user, call, tool, answer = episode_messages()
    tools = [SHELL_SPEC]
    prompt1 = family.render_ids(tokenizer, [user], tools, add_generation_prompt=True)
    reply1 = reply_ids(family, tokenizer, [user], call, tools)
    parsed1 = family.parse_reply(tokenizer, reply1, tools=tools)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed1.tool_calls]
    if parsed1.status != "ok" or calls != [("shell", {"command": COMMAND})]:
        raise ValueError(f"reply 1 parses as {parsed1}, not the scripted shell call")
    suffix = family.suffix_ids(
        tokenizer,
        [tool],
        tools,
        add_generation_prompt=True,
        previous=parsed1.to_message(),
        stop_id=reply1[-1],
    )
    reply2 = reply_ids(family, tokenizer, [user, call, tool], answer, tools)
    parsed2 = family.parse_reply(tokenizer, reply2, tools=tools)
    if parsed2.status != "ok" or parsed2.content != "done" or parsed2.tool_calls:
        raise ValueError(f"reply 2 parses as {parsed2}, not 'done'")
    return ScriptedEpisode((0, 0), tuple(prompt1), tuple(reply1), tuple(suffix), tuple(reply2))


def build_shell_model(dest: Path, family: Any, tokenizer: Any) -> Path:
    """Train the model on the one episode and save it with its tokenizer into ``dest``."""
    import torch
    from transformers import Qwen3ForCausalLM

    episodes = [script_shell_episode(family, tokenizer)]
    vocab = sorted({token for episode in episodes for token in episode.ids})
    compact_of = {token: index for index, token in enumerate(vocab)}
    torch.manual_seed(SEED)
    compact = Qwen3ForCausalLM(tool_model_config(tokenizer, vocab_size=len(vocab)))
    batch = _Batch.of(episodes, compact_of)
    optimizer = torch.optim.Adam(compact.parameters(), lr=LEARNING_RATE)
    rest = torch.full((batch.targets.numel(), 1), math.log(len(tokenizer) - len(vocab)))
    started = time.perf_counter()
    steps = 0
    while True:
        hidden = compact.model(input_ids=batch.inputs).last_hidden_state
        logits = compact.lm_head(hidden[batch.rows, batch.columns])
        logprobs = torch.log_softmax(torch.cat([logits, rest], dim=1), dim=1)
        target = logprobs.gather(1, batch.targets[:, None])[:, 0]
        if math.exp(float(target.detach().min())) >= TRAIN_PROBABILITY:
            break
        if steps == MAX_STEPS:
            raise RuntimeError(f"the shell model did not learn its script in {MAX_STEPS} steps")
        optimizer.zero_grad(set_to_none=True)
        (-target.mean()).backward()
        optimizer.step()
        steps += 1
    with torch.no_grad():
        compact.lm_head.weight.mul_(SHARPEN)
    model = _expand(compact, vocab, tool_model_config(tokenizer))
    lowest = min(min(p) for p in script_probabilities(model, episodes))
    if lowest < TARGET_PROBABILITY:
        raise RuntimeError(f"the shell model gives a scripted token only {lowest:.6f}")
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / "training.json").write_text(
        json.dumps(
            {"steps": steps, "seconds": round(time.perf_counter() - started, 3), "min_probability": lowest}
        )
    )
    return dest
