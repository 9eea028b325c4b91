"""What every record-based data source shares: record → Prompt mapping, and a resumable order.

A concrete source (a file, a ``datasets`` dataset, a procedural generator) only turns
its input into a list of records; :class:`PromptPool` maps them to prompts once, up
front (so a bad record fails before a run starts), and hands them out in a seeded,
per-epoch shuffled order whose position is a small JSON-able state dict.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.errors import ConfigError, DataError
from miles.types import ChatMessage, Prompt

Where = Callable[[], str]  # builds "file x.jsonl, line 3" only when an error needs it


@dataclass(frozen=True)
class PromptFormat:
    """How one record becomes a :class:`~miles.types.Prompt` (the recipe's ``data`` keys)."""

    prompt_key: str = "prompt"
    label_key: str | None = "label"
    metadata_keys: tuple[str, ...] = ()
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"

    def __post_init__(self) -> None:
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"data.prompt_template {self.prompt_template!r} is not a valid template ({exc!r}); it may only "
                "use {prompt}, and literal braces must be doubled ({{ and }})"
            ) from None
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ConfigError(
                "data.system_prompt is set but data.apply_chat_template is false: a system prompt needs the chat "
                "template; set apply_chat_template: true or put the instruction in data.prompt_template"
            )

    def to_prompt(self, index: int, record: Any, where: Where) -> Prompt:
        if not isinstance(record, Mapping):
            raise DataError(
                f"{where()}: expected an object with a {self.prompt_key!r} field, got {type(record).__name__}"
            )
        if self.prompt_key not in record:
            raise DataError(
                f"{where()}: missing field {self.prompt_key!r} (data.prompt_key); fields: {_fields(record)}"
            )
        prompt = self._prompt(record[self.prompt_key], where)
        label = self._label(record, where)
        metadata = {}
        for key in self.metadata_keys:
            if key not in record:
                raise DataError(
                    f"{where()}: missing field {key!r} (listed in data.metadata_keys); fields: {_fields(record)}"
                )
            metadata[key] = record[key]
        return Prompt(index=index, prompt=prompt, label=label, metadata=metadata)

    def _prompt(self, value: Any, where: Where) -> str | list[ChatMessage]:
        field = self.prompt_key
        if isinstance(value, str):
            if not value.strip():
                raise DataError(f"{where()}: field {field!r} is empty")
            text = self.prompt_template.format(prompt=value)
            if not self.apply_chat_template:
                return text
            messages: list[ChatMessage] = []
            if self.system_prompt is not None:
                messages.append({"role": "system", "content": self.system_prompt})
            messages.append({"role": "user", "content": text})
            return messages
        if isinstance(value, list):
            if not self.apply_chat_template:
                raise DataError(
                    f"{where()}: field {field!r} is a list of chat messages but data.apply_chat_template is false; "
                    "set it to true, or give the prompt as a string"
                )
            messages = [self._message(m, i, where) for i, m in enumerate(value)]
            if not messages:
                raise DataError(f"{where()}: field {field!r} is an empty list of messages")
            if self.system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            if self.prompt_template != "{prompt}":
                last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
                if last_user is not None and isinstance(last_user["content"], str):
                    last_user["content"] = self.prompt_template.format(prompt=last_user["content"])
            return messages
        raise DataError(
            f"{where()}: field {field!r} must be a string or a list of chat messages, got {type(value).__name__}"
        )

    def _message(self, value: Any, i: int, where: Where) -> ChatMessage:
        field = f"{self.prompt_key}[{i}]"
        if not isinstance(value, Mapping):
            raise DataError(
                f"{where()}: field {field!r} must be a message object, got {type(value).__name__}"
            )
        if not isinstance(value.get("role"), str):
            raise DataError(f"{where()}: field {field!r} needs a string 'role'")
        if not isinstance(value.get("content"), str | list):
            raise DataError(f"{where()}: field {field!r} needs a 'content' (a string or a list of parts)")
        return copy.deepcopy(dict(value))

    def _label(self, record: Mapping[str, Any], where: Where) -> str | None:
        if self.label_key is None:
            return None
        if record.get(self.label_key) is None:
            raise DataError(
                f"{where()}: missing field {self.label_key!r} (data.label_key; set it to null for unlabeled data); "
                f"fields: {_fields(record)}"
            )
        value = record[self.label_key]
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise DataError(
            f"{where()}: field {self.label_key!r} must be a string or a number, got {type(value).__name__}"
        )


def _fields(record: Mapping[str, Any]) -> str:
    names = [str(k) for k in record]
    return ", ".join(names[:10]) + (" ..." if len(names) > 10 else "") if names else "none"


class PromptOrder:
    """Indices ``0..size-1`` in a per-epoch order (seeded by ``seed`` and the epoch), plus a retry queue."""

    def __init__(self, size: int, *, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # position inside the current epoch's order
        self.retry: list[int] = []
        self._perm_epoch = -1
        self._perm: list[int] = []

    def permutation(self, epoch: int) -> list[int]:
        if self._perm_epoch != epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def take(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot take {n} prompts")
        out = self.retry[:n]
        del self.retry[:n]
        while len(out) < n:
            if self.offset >= self.size:
                self.epoch += 1
                self.offset = 0
            perm = self.permutation(self.epoch)
            step = min(n - len(out), self.size - self.offset)
            out.extend(perm[self.offset : self.offset + step])
            self.offset += step
        if self.offset >= self.size:  # keep the state canonical: a finished epoch is the start of the next
            self.epoch += 1
            self.offset = 0
        return out

    def put_back(self, indices: Sequence[int]) -> None:
        bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < self.size)]
        if bad:
            raise DataError(
                f"put_back: prompt indices {bad[:5]} are not from this data source (it has {self.size})"
            )
        self.retry[:0] = list(indices)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "retry": list(self.retry),
            "num_prompts": self.size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            epoch, offset, retry, size = (state[k] for k in ("epoch", "offset", "retry", "num_prompts"))
        except (KeyError, TypeError):
            raise DataError(
                f"cannot resume the data source: state {dict(state) if isinstance(state, Mapping) else state!r} "
                "lacks epoch/offset/retry/num_prompts"
            ) from None
        if size != self.size:
            raise DataError(
                f"cannot resume the data source: the checkpoint was taken over {size} prompts, the data now has "
                f"{self.size}; the dataset changed since the run started"
            )
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(offset, int) and 0 <= offset <= size):
            raise DataError(f"cannot resume the data source: bad position epoch={epoch!r} offset={offset!r}")
        self.epoch, self.offset, self.retry = epoch, offset, []
        self.put_back(list(retry))


class PromptPool:
    """A :class:`~miles.interfaces.DataSource` over prompts mapped up front."""

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int, name: str) -> None:
        if not prompts:
            raise DataError(f"{name} holds no prompts")
        self._prompts = prompts
        self._order = PromptOrder(len(prompts), shuffle=shuffle, seed=seed)

    def next_prompts(self, n: int) -> list[Prompt]:
        # Copies, so a rollout that annotates its prompt never changes what a later epoch hands out.
        return [copy.deepcopy(self._prompts[i]) for i in self._order.take(n)]

    def put_back(self, prompts: Iterable[Prompt]) -> None:
        self._order.put_back([p.index for p in prompts])

    def state_dict(self) -> dict[str, Any]:
        return self._order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._order.load_state_dict(state)

    def __len__(self) -> int:
        return len(self._prompts)


def map_records(records: Iterable[tuple[Any, Where]], fmt: PromptFormat) -> list[Prompt]:
    """Map ``(record, where)`` pairs to prompts indexed by position."""
    return [fmt.to_prompt(i, record, where) for i, (record, where) in enumerate(records)]


def check_options(options: Mapping[str, Any] | None, allowed: Sequence[str], source: str) -> dict[str, Any]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"data.options: unknown key(s) {', '.join(unknown)} for data source {source!r}; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )
    return options
