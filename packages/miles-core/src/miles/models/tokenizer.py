"""The tokenizer of the built-in tiny models: a small byte-level BPE trained here, deterministically.

Why train one instead of shipping a file: no model hub is reachable, and a tokenizer
trained from a generated corpus is reproducible byte for byte from this source.
Design points:

* byte-level BPE (every string round-trips, like Qwen's tokenizer), a few hundred tokens;
* a pre-tokenizer that isolates every digit, so ``0``..``9`` are always single tokens
  and arithmetic answers are one token each;
* ChatML special tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) with ids 0..2,
  ``<|im_end|>`` as eos and ``<|endoftext|>`` as pad;
* a ChatML chat template written for this project (system/user/assistant/tool turns,
  ``add_generation_prompt``, ``{% generation %}`` markers for assistant masks).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2 in this order

VOCAB_SIZE = 384
# The corpus seed is fixed on purpose: every tiny model (whatever its weight seed) shares one tokenizer.
CORPUS_SEED = 1234

# Digits and letter runs are split apart; each digit stands alone so BPE can never merge digits.
PRETOKENIZE_PATTERN = r"\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s*\n|\s+(?!\S)|\s+"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unsupported chat role ' ~ message['role'] ~ '; use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{- raise_exception('a system message is only allowed as the first message') }}"
    "{%- endif %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('message content must be a string') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = (
    "the a an is are was what which who how many much please compute calculate add sum total of and "
    "plus minus times divided by equals answer result number numbers final step first then so we "
    "get have has it this that you your I me my can could help today hello hi thanks thank sure "
    "here there yes no not okay good great question problem solve check again let us think about "
    "one two three four five six seven eight nine ten zero more less than each every apples books "
    "cats dogs friends people day days week hour hours minute price cost money left right correct"
)
_WORDS = _WORD_TEXT.split()

_GREETINGS = [
    "Hello! How can I help you today?",
    "Hi there. What would you like to know?",
    "Sure, I can help with that.",
    "Thanks! Let me think about it.",
    "You are a helpful assistant.",
    "You are a careful math tutor. Answer with a single number.",
    "Please put the final answer in \\boxed{}.",
]


def training_corpus(seed: int = CORPUS_SEED) -> list[str]:
    """Arithmetic and short chat text, generated deterministically from ``seed``."""
    rng = random.Random(seed)
    lines: list[str] = []
    for a in range(21):
        for b in range(21):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a} - {b} = {a - b}")
            lines.append(f"{a}*{b}={a * b}")
    for _ in range(400):
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(
            rng.choice(
                [
                    f"What is {a} plus {b}?",
                    f"Compute {a} + {b}.",
                    f"The answer is {a + b}.",
                    f"So the result is \\boxed{{{a + b}}}.",
                    f"{a} apples and {b} apples make {a + b} apples.",
                ]
            )
        )
    for _ in range(600):
        n = rng.randint(3, 10)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","]))
    for _ in range(200):
        lines.append(rng.choice(_GREETINGS))
        # Role names as the chat template lays them out, so they become single tokens.
        lines.append(
            f"system\n{rng.choice(_GREETINGS)}\nuser\n{rng.randrange(10)}+{rng.randrange(10)}=\nassistant\n"
        )
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny-model tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
