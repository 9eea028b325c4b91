"""A served teacher: an engine that scores each finished trajectory during rollout.

The student samples a response; the teacher (SGLang or the embedded engine, any
architecture, but the student's tokenizer) scores the student's own token ids in one
forward pass. Per response token ``t`` the scorer records

- ``token_scores["teacher_logprobs"][t] = log π_teacher(x_t | x_<t)``, at the rollout
  temperature (logits / T, as the student's ``rollout_logprobs``), so that
  ``rollout_logprobs[t] − teacher_logprobs[t]`` is the one-sample reverse-KL estimate;
- with ``top_k`` K > 0, also ``token_scores["opd_reverse_kl"][t]``: the top-K estimate
  of :mod:`miles.distill.topk` over the student's top-K ids (``candidates="student"``) or
  their intersection with the teacher's top-K (``"intersection"``). The student's top-K
  comes from a scoring call to the engine that generated the sample.

The log-probs travel with the sample to the trainer, which folds them into the
advantages (``miles.builtins.algorithms.opd``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from miles.distill.topk import CANDIDATES, Candidates, reverse_kl_sequence
from miles.engines.client import SGLangClient
from miles.errors import ConfigError, EngineError
from miles.interfaces import OPD_REVERSE_KL, TEACHER_LOGPROBS, EngineClient, RolloutContext
from miles.types import Sample

#: ``token_scores`` key of the top-K estimate (read by the advantage folding).
#: The teacher of prompts whose metadata carries no routing tag.
DEFAULT_TEACHER = "default"

# The fixed part of the tokenizer probe: prose, digits, code, many scripts, emoji and odd whitespace,
# where tokenizers that differ at all usually differ.
PROBE_TEXT = (
    "Hello, world! The quick brown fox jumps over the lazy dog.\n"
    "Numbers: 0 1 42 007 3.14159 -273.15 1e-9 2024-06-30 12:34:56 +1 (555) 010-9999 1,000,000\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n"
    '\tif x != 0 and y <= 1: print(f"{x=} {y!r}"); d = {"k": [1, 2]}; s = r"\\d+\\s*"\n'
    "Unicode: café naïve Größe ½ ™ 日本語のテキスト 中文 한국어 Ελληνικά русский العربية עברית हिन्दी "
    "😀🚀👩‍💻 ∑∫√π≤≥≠∞\n"
    "Whitespace:   three spaces\t\ttwo tabs\n\n\nthree newlines\r\n  trailing   "
)


def _as_client(teacher: EngineClient | str, timeout: float) -> EngineClient:
    """A URL is spoken to over SGLang's native API (which both built-in engine kinds serve); a run
    hands in its engine kind's own clients (``miles.capabilities.engine_client_factory``)."""
    return SGLangClient(teacher, timeout=timeout) if isinstance(teacher, str) else teacher


def _is_client(teacher: object) -> bool:
    return isinstance(getattr(teacher, "url", None), str) and callable(getattr(teacher, "score", None))


class ServedTeacher:
    """A :data:`~miles.interfaces.SampleScorer` that asks served teachers for log-probs.

    ``teachers`` maps names to engines (an :class:`~miles.interfaces.EngineClient`, e.g. the engine
    kind's own client, or the URL of an engine serving SGLang's native API). A sample goes to
    the teacher named by ``sample.prompt.metadata[route_key]``, else to ``"default"``.
    ``temperature`` must be the rollout's: teacher and student log-probs are both taken
    from ``logits / T`` (0 means greedy sampling, scored at T = 1). ``top_k`` 0 records
    ``teacher_logprobs`` only; K > 0 adds ``opd_reverse_kl`` over ``candidates``.

    ``candidates="student"`` asks the teacher for its log-probs on the student's K ids at
    each position (``token_ids_logprob`` with one id list per position: an embedded-engine
    extension, so the teacher must be an embedded engine); ``"intersection"`` asks for the
    teacher's own top-K (plain SGLang) and runs both scoring calls concurrently.
    """

    def __init__(
        self,
        teachers: Mapping[str, EngineClient | str],
        *,
        route_key: str = "teacher",
        temperature: float = 1.0,
        top_k: int = 0,
        candidates: Candidates = "student",
        timeout: float = 600.0,
    ) -> None:
        if not isinstance(teachers, Mapping) or not teachers:
            raise ConfigError(
                "served teacher: teachers must map at least one name to an engine URL or client"
            )
        bad = [name for name, t in teachers.items() if not (isinstance(t, str) or _is_client(t))]
        if bad:
            raise ConfigError(
                f"served teacher: teachers {bad} are neither an engine URL nor an engine client (with url and score)"
            )
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not (math.isfinite(temperature) and temperature >= 0)
        ):
            raise ConfigError(
                f"served teacher: temperature must be a finite number >= 0, got {temperature!r}"
            )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ConfigError(f"served teacher: top_k must be an integer >= 0, got {top_k!r}")
        if candidates not in CANDIDATES:
            raise ConfigError(f"served teacher: candidates {candidates!r} is not one of {CANDIDATES}")
        if not route_key:
            raise ConfigError("served teacher: route_key must be a non-empty metadata key")
        self.teachers = {str(name): _as_client(t, timeout) for name, t in teachers.items()}
        self.route_key = route_key
        self.temperature = float(temperature)
        self.top_k = top_k
        self.candidates: Candidates = candidates

    def __repr__(self) -> str:
        urls = {name: client.url for name, client in self.teachers.items()}
        return f"ServedTeacher({urls}, top_k={self.top_k}, candidates={self.candidates!r})"

    def teacher_for(self, sample: Sample) -> tuple[str, EngineClient]:
        """The (name, client) that scores ``sample``; ValueError when its tag names no teacher."""
        tag = sample.prompt.metadata.get(self.route_key)
        name = DEFAULT_TEACHER if tag is None else str(tag)
        client = self.teachers.get(name)
        if client is None:
            known = ", ".join(sorted(self.teachers))
            why = (
                f"has no {self.route_key!r} tag in its metadata and there is no {DEFAULT_TEACHER!r} teacher"
                if tag is None
                else f"is tagged {self.route_key}={tag!r}, which names no teacher"
            )
            raise ValueError(f"served teacher: the prompt {sample.prompt.index} {why} (teachers: {known})")
        return name, client

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> None:
        """Score ``sample``'s response with its teacher; fills ``sample.token_scores``."""
        _, teacher = self.teacher_for(sample)
        if not sample.response_ids:
            sample.token_scores[TEACHER_LOGPROBS] = []
            if self.top_k:
                sample.token_scores[OPD_REVERSE_KL] = []
            return
        ids = [*sample.prompt_ids, *sample.response_ids]
        start = len(sample.prompt_ids)
        t = self.temperature
        if not self.top_k:
            out = await teacher.score(ids, start=start, temperature=t)
            sample.token_scores[TEACHER_LOGPROBS] = out.logprobs
            return
        student = self._student(ctx, sample)
        k = self.top_k
        if self.candidates == "student":
            mine = await student.score(ids, start=start, temperature=t, top_k=k)
            theirs = await teacher.score(ids, start=start, temperature=t, token_ids=mine.top_ids)
            teacher_ids, teacher_lps = mine.top_ids, theirs.token_ids_logprobs
        else:
            mine, theirs = await asyncio.gather(
                student.score(ids, start=start, temperature=t, top_k=k),
                teacher.score(ids, start=start, temperature=t, top_k=k),
            )
            teacher_ids, teacher_lps = theirs.top_ids, theirs.top_logprobs
        # score() fills top_ids/top_logprobs when asked with top_k, token_ids_logprobs with token_ids:
        assert mine.top_ids is not None and mine.top_logprobs is not None
        assert teacher_ids is not None and teacher_lps is not None
        sample.token_scores[TEACHER_LOGPROBS] = theirs.logprobs
        sample.token_scores[OPD_REVERSE_KL] = reverse_kl_sequence(
            mine.top_ids,
            mine.top_logprobs,
            teacher_ids,
            teacher_lps,
            candidates=self.candidates,
            sampled_student=mine.logprobs,
            sampled_teacher=theirs.logprobs,
        )

    @staticmethod
    def _student(ctx: RolloutContext, sample: Sample) -> Any:
        """The engine that generated ``sample`` (the routing of ``builtins.rollout.generate``)."""
        engine = ctx.engine_for(sample.prompt.index * ctx.n_samples_per_prompt + sample.group_index)
        if not callable(getattr(engine, "score", None)):
            raise ValueError(
                f"served teacher: top_k needs the student's top-K, but the rollout engine client {engine!r} "
                "has no score method"
            )
        return engine

    async def check_tokenizer(self, tokenizer: Any) -> None:
        """:func:`check_same_tokenizer` against every teacher (concurrently); raises on the first mismatch."""
        await asyncio.gather(*(check_same_tokenizer(c, tokenizer) for c in self.teachers.values()))

    async def aclose(self) -> None:
        """Close the teachers' connection pools (of the running event loop)."""
        for client in self.teachers.values():
            close = getattr(
                client, "aclose", None
            )  # not part of EngineClient: a client may hold nothing open
            if close is not None:
                await close()


# ------------------------------------------------------------------ tokenizer check


def tokenizer_probe(tokenizer: Any) -> list[str]:
    """The probe texts: :data:`PROBE_TEXT`, the tokenizer's special tokens, a short chat rendered
    with its template (when it has one) and a spread of its vocabulary, decoded. Each is short
    (well under the smallest model context) and is checked on its own."""
    # One line at a time: a near character-level vocabulary makes the whole text longer than small contexts.
    parts = [line + "\n" for line in PROBE_TEXT.split("\n") if line]
    specials = [t for t in getattr(tokenizer, "all_special_tokens", None) or [] if t]
    if specials:
        parts.append(" ".join(specials))
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
        parts.append(tokenizer.apply_chat_template(chat, tokenize=False))
    size = len(tokenizer)
    sample_ids = list(range(0, size, max(1, size // 64)))
    for k in range(0, len(sample_ids), 16):
        parts.append(" ".join(tokenizer.decode([i]) for i in sample_ids[k : k + 16]))
    return parts


async def check_same_tokenizer(client: EngineClient | str, tokenizer: Any, *, timeout: float = 120.0) -> None:
    """Raise EngineError unless the engine at ``client`` tokenizes like ``tokenizer``.

    A served teacher scores the student's token ids, which is meaningful only when both
    share one vocabulary. The engine tokenizes each :func:`tokenizer_probe` text (its client's
    ``tokenize(text)``; SGLang's API sends it as ``text`` and generates nothing) and reports the
    ids it used; they must equal
    ``tokenizer.encode(probe)``, with or without the special tokens (BOS, ...) the
    tokenizer adds around a text, or with the tokenizer's BOS in front: whether an
    engine adds them is its own setting, and scoring sends ids, never text, so only the
    vocabulary has to agree. The error names the engine and the first position where
    the ids differ.
    """
    owned = isinstance(client, str)
    engine = _as_client(client, timeout)
    try:
        for probe in tokenizer_probe(tokenizer):
            await _check_probe(engine, tokenizer, probe, timeout)
    finally:
        close = getattr(engine, "aclose", None)
        if owned and close is not None:
            await close()


async def _check_probe(client: EngineClient, tokenizer: Any, probe: str, timeout: float) -> None:
    if isinstance(client, SGLangClient):
        engine_ids = await client.tokenize(probe, timeout=timeout)
    else:
        tokenize = getattr(client, "tokenize", None)
        if not callable(tokenize):
            raise EngineError(
                f"engine {client.url}: its client ({type(client).__module__}.{type(client).__qualname__}) has no "
                "tokenize(text), so Miles cannot check that this served teacher tokenizes like the student; "
                "give the engine kind's client an async tokenize(text) -> list[int]"
            )
        engine_ids = [int(i) for i in await asyncio.wait_for(tokenize(probe), timeout)]
    plain = list(tokenizer.encode(probe, add_special_tokens=False))
    with_specials = list(tokenizer.encode(probe))
    accepted = [plain, with_specials]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:  # an engine configured to add BOS where this tokenizer does not
        accepted.append([bos, *plain])
    if engine_ids in accepted:
        return
    reference = with_specials
    pos = next(
        (i for i, (a, b) in enumerate(zip(engine_ids, reference, strict=False)) if a != b),
        min(len(engine_ids), len(reference)),
    )
    context = tokenizer.decode(reference[max(0, pos - 8) : pos + 1])
    theirs = engine_ids[pos] if pos < len(engine_ids) else "the end of the text"
    ours = reference[pos] if pos < len(reference) else "the end of the text"
    raise EngineError(
        f"engine {client.url} does not share the student's tokenizer: tokenizing the probe text {probe[:40]!r}..., "
        f"the first difference is at token {pos} (engine: {theirs}, student: {ours}; student text up to there: "
        f"{context!r}; {len(engine_ids)} vs {len(reference)} tokens). A served teacher scores the student's "
        "token ids, so it must use the same tokenizer"
    )


__all__ = [
    "DEFAULT_TEACHER",
    "OPD_REVERSE_KL",
    "PROBE_TEXT",
    "ServedTeacher",
    "check_same_tokenizer",
    "tokenizer_probe",
]
