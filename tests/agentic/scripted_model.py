"""A tiny trained Qwen3 that really plays one calculator tool episode, for agentic end-to-end tests.

The episode, for each ``(a, b)`` in :data:`PAIRS`::

    user       What is {a}+{b}?
    assistant  (no text) tool call calculator(expression="{a}+{b}")   <|im_end|>
    tool       {a+b}
    assistant  {a+b}                                                    <|im_end|>

The model is trained on exactly the token ids the session server produces for this episode in
the ``qwen3`` family (``enable_thinking`` left unset, as the session server does, so every reply
starts with the empty think block the template renders): turn 1 is the rendered first prompt, the model's reply is the
assistant message as the template renders it up to and including ``<|im_end|>``, and turn 2 is
that history plus :meth:`ModelFamily.suffix_ids` for the tool result. Only reply tokens carry
loss. Greedy decoding then reproduces both replies of every pair, and each scripted token has
probability at least :data:`TARGET_PROBABILITY`, so temperature-1 sampling follows the whole
script too: with at most 34 generated tokens per episode (27 + 7), an episode leaves it with
probability below 0.4% (see :func:`script_probabilities`; the trained model is far inside that bound).

Training is fast because it runs on a *compact vocabulary*: the ~100 token ids that occur in the
episodes. The saved model has the full Qwen3 vocabulary; the rows of ``lm_head`` for every other
token are zero, so their logits are exactly 0, and training accounts for them exactly by adding
one constant logit ``log(#other tokens)`` to the compact softmax (``sum(exp(0))`` over them).
The full model therefore computes the same probabilities as the compact one it was trained as.

Training stops at :data:`TRAIN_PROBABILITY` (plain cross-entropy only creeps towards a wide
margin), then the scripted tokens are *sharpened*: ``lm_head`` is scaled by :data:`SHARPEN`, which
is sampling the learned distribution at temperature ``1 / SHARPEN``. Every scripted token is the
top-1 with a positive logit (it beats the zero logits of the other tokens), so scaling by ``s``
raises each odds ratio ``(1 - p) / p`` to at least its ``s``-th power: 0.99 becomes 0.999999 for
``s = 3``. :func:`build_tool_model` measures the margin on the full model before saving.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_envs.tools.calculator import Calculator

#: The one tool of the episode: the built-in calculator tool set's spec (`agentic.tools: calculator`).
CALCULATOR_SPEC: dict[str, Any] = Calculator().specs()[0]

#: The (a, b) pairs the model was trained on; it knows no others. Sums are distinct, and one- and
#: two-digit operands both occur, so the replies differ in length and in every digit position.
PAIRS: tuple[tuple[int, int], ...] = ((2, 3), (7, 5), (4, 9), (12, 30), (25, 17), (61, 8))

#: The id of the assistant's tool call in :func:`episode_messages` (Qwen3 does not render ids).
TOOL_CALL_ID = "call_calculator_0"

#: Training stops once every scripted token has at least this probability (full vocabulary)...
TRAIN_PROBABILITY = 0.99
#: ...then lm_head is scaled by this factor (see the module docstring)...
SHARPEN = 3.0
#: ...and the saved model must give every scripted token at least this probability.
TARGET_PROBABILITY = 0.9999
MAX_STEPS = 600
LEARNING_RATE = 1e-2
SEED = 0

Message = dict[str, Any]


def episode_messages(a: int, b: int) -> list[Message]:
    """The four messages of the episode for ``a + b`` in OpenAI form (the reference transcript)."""
    _check_pair(a, b)
    expression = f"{a}+{b}"
    call = {
        "id": TOOL_CALL_ID,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def _check_pair(a: Any, b: Any) -> None:
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (a, b)):
        raise ValueError(f"episode operands must be non-negative ints, got a={a!r}, b={b!r}")


# ---------------------------------------------------------------------------- token sequences


@dataclass(frozen=True)
class ScriptedEpisode:
    """The ids of one episode as the session server sends and the model must answer them.

    ``prompt1``: the first render (``render_ids`` of the user message, with the generation prompt).
    ``reply1``: the tool-call reply, ending with the stop token. ``suffix``: what the server
    appends for the tool result (``suffix_ids``, ending with the generation prompt). ``reply2``:
    the answer, ending with the stop token. Turn 2's prompt is ``prompt1 + reply1 + suffix``.
    """

    pair: tuple[int, int]
    prompt1: tuple[int, ...]
    reply1: tuple[int, ...]
    suffix: tuple[int, ...]
    reply2: tuple[int, ...]

    @property
    def prompt2(self) -> list[int]:
        return [*self.prompt1, *self.reply1, *self.suffix]

    @property
    def ids(self) -> list[int]:
        """The whole episode: turn 2's prompt followed by the last reply."""
        return [*self.prompt2, *self.reply2]

    def reply_positions(self) -> list[int]:
        """Indices into :attr:`ids` of the tokens the model generates (both replies)."""
        start1 = len(self.prompt1)
        start2 = len(self.prompt2)
        return [*range(start1, start1 + len(self.reply1)), *range(start2, start2 + len(self.reply2))]


def reply_ids(
    family: Any,
    tokenizer: Any,
    history: Sequence[Mapping[str, Any]],
    reply: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    """The ids a model trained on ``family``'s template generates for ``reply`` after ``history``.

    That is the rendered reply from the end of the generation prompt up to and including the
    family's turn end (the stop token), as ``miles_envs.families.check`` defines a reply; the rest of
    the rendered turn (Qwen3's newline after ``<|im_end|>``) belongs to the next suffix.
    """
    prompt = family.render_text(tokenizer, history, tools, add_generation_prompt=True)
    full = family.render_text(tokenizer, [*history, reply], tools, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise ValueError(f"family {family.name!r}: the rendered reply does not extend the generation prompt")
    end, consumed = family.reply_end(full, len(prompt), tokenizer)
    if consumed is not None:
        raise ValueError(f"family {family.name!r} stops on the next role token; only turn-end families work")
    return list(tokenizer.encode(full[len(prompt) : end], add_special_tokens=False))


def script_episode(family: Any, tokenizer: Any, a: int, b: int) -> ScriptedEpisode:
    """Build the ids of the episode for ``a + b`` and check that both replies parse back.

    Raises ``ValueError`` if a reply does not parse into the scripted message (wrong tool call,
    content, or a missing stop token): the model would then be trained on a script the session
    server reads differently.
    """
    user, call, tool, answer = episode_messages(a, b)
    tools = [CALCULATOR_SPEC]
    prompt1 = family.render_ids(tokenizer, [user], tools, add_generation_prompt=True)
    reply1 = reply_ids(family, tokenizer, [user], call, tools)
    parsed1 = _parsed(family, tokenizer, reply1, (a, b), "reply 1")
    if parsed1.content or _calls(parsed1.tool_calls) != _calls(call["tool_calls"]):
        raise ValueError(
            f"pair {(a, b)}: reply 1 parses as {parsed1.to_message()}, not the scripted tool call"
        )
    # The server passes the stored (parsed) reply as `previous`, and the reply's last token as the stop.
    suffix = family.suffix_ids(
        tokenizer,
        [tool],
        tools,
        add_generation_prompt=True,
        previous=parsed1.to_message(),
        stop_id=reply1[-1],
    )
    reply2 = reply_ids(family, tokenizer, [user, call, tool], answer, tools)
    parsed2 = _parsed(family, tokenizer, reply2, (a, b), "reply 2")
    if parsed2.content != answer["content"] or parsed2.tool_calls:
        raise ValueError(
            f"pair {(a, b)}: reply 2 parses as {parsed2.to_message()}, not {answer['content']!r}"
        )
    return ScriptedEpisode((a, b), tuple(prompt1), tuple(reply1), tuple(suffix), tuple(reply2))


def _parsed(family: Any, tokenizer: Any, ids: list[int], pair: tuple[int, int], which: str) -> Any:
    parsed = family.parse_reply(tokenizer, ids, tools=[CALCULATOR_SPEC])
    if parsed.status != "ok" or not parsed.stopped:
        raise ValueError(f"pair {pair}: {which} does not parse cleanly: {parsed}")
    return parsed


def _calls(calls: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """Tool calls by (name, arguments as JSON values); ids are the server's own and not compared."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def script_episodes(family: Any, tokenizer: Any) -> list[ScriptedEpisode]:
    """:func:`script_episode` for every pair in :data:`PAIRS`."""
    return [script_episode(family, tokenizer, a, b) for a, b in PAIRS]


# ---------------------------------------------------------------------------- the model


def tool_model_config(tokenizer: Any, vocab_size: int | None = None) -> Any:
    """The tiny Qwen3 config (full vocabulary unless ``vocab_size`` is given, for the compact twin)."""
    from transformers import Qwen3Config

    # The compact twin never generates, and its ids are not real ids: it gets no eos.
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if vocab_size is None else None
    return Qwen3Config(
        vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # the zero lm_head rows of unused tokens must not zero their inputs
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=end,
    )


@dataclass(frozen=True)
class TrainingReport:
    """How training went: Adam steps, seconds spent (training only, not tokenizing or checking),
    the compact vocabulary size, the smallest scripted-token probability when training stopped,
    and the smallest one the saved (sharpened, full-vocabulary) model gives; every scripted token
    is also the model's top-1 choice."""

    steps: int
    seconds: float
    compact_vocab: int
    trained_min_probability: float
    min_probability: float

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "compact_vocab": self.compact_vocab,
            "trained_min_probability": self.trained_min_probability,
            "min_probability": self.min_probability,
        }


def train_tool_model(family: Any, tokenizer: Any) -> tuple[Any, TrainingReport]:
    """Train the tiny model on :func:`script_episodes`; returns the full-vocabulary model and a report.

    Deterministic for a given torch build and thread count (fixed seed, full-batch Adam, stopping
    at a fixed criterion). Raises ``RuntimeError`` if the script is not learned within
    :data:`MAX_STEPS` steps, or the saved model's margin falls short of :data:`TARGET_PROBABILITY`.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    episodes = script_episodes(family, tokenizer)
    started = time.perf_counter()
    vocab = sorted({token for episode in episodes for token in episode.ids})
    compact_of = {token: index for index, token in enumerate(vocab)}
    others = len(tokenizer) - len(vocab)

    torch.manual_seed(SEED)
    compact = Qwen3ForCausalLM(tool_model_config(tokenizer, vocab_size=len(vocab)))
    batch = _Batch.of(episodes, compact_of)
    optimizer = torch.optim.Adam(compact.parameters(), lr=LEARNING_RATE)
    # The logit shared by every token outside the compact vocabulary: their lm_head rows are zero,
    # so together they contribute others * exp(0) to the softmax's denominator.
    rest = torch.full((batch.targets.numel(), 1), math.log(others))
    compact.train()
    step = 0
    while True:
        hidden = compact.model(input_ids=batch.inputs).last_hidden_state
        # Logits at the scripted positions only, and over the compact vocabulary plus `rest`.
        logits = compact.lm_head(hidden[batch.rows, batch.columns])
        logprobs = torch.log_softmax(torch.cat([logits, rest], dim=1), dim=1)
        target_logprobs = logprobs.gather(1, batch.targets[:, None])[:, 0]
        trained_min = math.exp(float(target_logprobs.detach().min()))
        if trained_min >= TRAIN_PROBABILITY:
            break
        if step == MAX_STEPS:
            raise RuntimeError(
                f"the tool model did not learn its script in {MAX_STEPS} steps "
                f"(min scripted-token probability {trained_min:.4f}, wanted {TRAIN_PROBABILITY})"
            )
        loss = -target_logprobs.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
    seconds = time.perf_counter() - started
    with torch.no_grad():
        compact.lm_head.weight.mul_(SHARPEN)

    model = _expand(compact, vocab, tool_model_config(tokenizer))
    probabilities = script_probabilities(model, episodes)
    report = TrainingReport(step, seconds, len(vocab), trained_min, min(min(p) for p in probabilities))
    if report.min_probability < TARGET_PROBABILITY:
        raise RuntimeError(
            f"the saved tool model gives a scripted token only {report.min_probability:.6f} "
            f"(wanted at least {TARGET_PROBABILITY}; trained to {trained_min:.6f})"
        )
    return model, report


@dataclass(frozen=True)
class _Batch:
    """Right-padded compact ids (padding is causal-invisible to real tokens), and for each scripted
    token the (row, column) of the hidden state that predicts it and its compact id."""

    inputs: Any
    rows: Any
    columns: Any
    targets: Any

    @classmethod
    def of(cls, episodes: Sequence[ScriptedEpisode], compact_of: Mapping[int, int]) -> _Batch:
        import torch

        width = max(len(episode.ids) for episode in episodes)
        inputs = torch.zeros((len(episodes), width), dtype=torch.long)
        rows, columns, targets = [], [], []
        for row, episode in enumerate(episodes):
            ids = [compact_of[token] for token in episode.ids]
            inputs[row, : len(ids)] = torch.tensor(ids)
            for position in episode.reply_positions():
                rows.append(row)
                columns.append(position - 1)  # the state at position p - 1 predicts token p
                targets.append(ids[position])
        return cls(inputs, torch.tensor(rows), torch.tensor(columns), torch.tensor(targets))


def _expand(compact: Any, vocab: Sequence[int], config: Any) -> Any:
    """The full-vocabulary model: the compact weights, with token rows placed at their real ids and
    zero rows (embedding and lm_head) for every token outside the script."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(config)
    state = {key: value for key, value in compact.state_dict().items() if not _is_vocab_weight(key)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not _is_vocab_weight(key) for key in missing):
        raise RuntimeError(f"compact and full models differ beyond the vocabulary: {missing}, {unexpected}")
    index = torch.tensor(list(vocab))
    with torch.no_grad():
        for full, small in (
            (model.model.embed_tokens.weight, compact.model.embed_tokens.weight),
            (model.lm_head.weight, compact.lm_head.weight),
        ):
            full.zero_()
            full[index] = small
    return model.eval()


def _is_vocab_weight(key: str) -> bool:
    return key in ("model.embed_tokens.weight", "lm_head.weight")


def script_probabilities(model: Any, episodes: Sequence[ScriptedEpisode]) -> list[list[float]]:
    """Per episode, the probability the model gives each scripted reply token (full softmax).

    Raises ``AssertionError`` naming the pair and position if a scripted token is not the top-1
    choice, i.e. if greedy decoding would leave the script.
    """
    import torch

    out = []
    with torch.no_grad():
        for episode in episodes:
            ids = episode.ids
            positions = episode.reply_positions()
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            logits = model.lm_head(hidden[[p - 1 for p in positions]]).float()
            probs = torch.softmax(logits, dim=-1)
            targets = torch.tensor([ids[p] for p in positions])
            top = probs.argmax(dim=-1)
            wrong = (top != targets).nonzero()
            if len(wrong):
                at = positions[int(wrong[0, 0])]
                raise AssertionError(f"pair {episode.pair}: greedy leaves the script at token {at}")
            out.append(probs.gather(1, targets[:, None])[:, 0].tolist())
    return out


def build_tool_model(dest: Path, family: Any, tokenizer: Any) -> Path:
    """Train the tool model and save it (``save_pretrained``), its tokenizer and ``training.json``
    (:class:`TrainingReport`) into ``dest``; returns ``dest``."""
    model, report = train_tool_model(family, tokenizer)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / "training.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return dest


def load_training_report(model_dir: Path) -> TrainingReport:
    """The report :func:`build_tool_model` saved next to the model."""
    data = json.loads((model_dir / "training.json").read_text())
    return TrainingReport(**data)


__all__ = [
    "CALCULATOR_SPEC",
    "PAIRS",
    "SHARPEN",
    "TARGET_PROBABILITY",
    "TOOL_CALL_ID",
    "TRAIN_PROBABILITY",
    "ScriptedEpisode",
    "TrainingReport",
    "build_tool_model",
    "episode_messages",
    "load_training_report",
    "reply_ids",
    "script_episode",
    "script_episodes",
    "script_probabilities",
    "train_tool_model",
]
