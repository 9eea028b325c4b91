"""Sessions: which recorded checkpoint a request extends, and recording the result.

The agent sends its whole message list every turn. ``Session.plan`` compares it, message
by message with the session's replay matcher, against what was recorded and decides
where the request attaches; ``Session.commit`` records the generation as a new checkpoint.
Between the two the caller renders the new messages, generates, and parses the reply,
without holding any lock: the store never waits on an engine.

Two rules (selected per store):

* ``LinearSession``: one growing sequence. A request must extend the recorded path, or
  retry the most recent turn (diverge inside its messages, e.g. resend its prompt), which
  replaces that turn's checkpoint once the retry is committed. Anything that diverges
  earlier is refused with the index of the first differing message and why. At most one
  request generates at a time: a second one while the first is in flight is refused
  (``SessionBusy``) rather than queued, because it could only extend a history that does
  not exist yet. One training sequence.
* ``BranchingSession``: an append-only tree. A request attaches to the deepest checkpoint
  whose whole message path is a prefix of it (ties: the newest); the rest opens a branch
  (a new root when nothing matches). Nothing is deleted; concurrent requests are allowed
  and requests from one checkpoint become siblings. Each selected leaf is one training
  sequence.

Both refuse to extend a checkpoint whose generation stopped at the length limit
(``TruncatedBranch``: its reply was cut off) or was aborted by the engine
(``AbortedBranch``); retrying that turn is allowed. Each session serialises ``plan``,
``commit`` and reads with its own lock, so it is safe to call from threads and from
coroutines on one event loop alike.

Replays are recognised, not re-judged. Parsing and matching the whole resent history every
turn would make a turn cost grow with the conversation. So once the matcher has accepted a
message as the recorded one at some place, the session keeps the message as it was sent there
(its ``replay_key``: a frozen copy of the plain JSON value) with its parse. A later request
whose message at that place is the same JSON value (``==``, compared for the whole history at
once, at C speed) reuses both; only the other messages (normally the last turn's) are parsed
and put to the matcher. This relies on the matcher being a function of the two messages (the
same pair, the same answer), which every built-in is and every user matcher must be; it does
not rely on the matcher accepting identical messages, since a verdict is only ever reused for
the exact pair it was given for.
"""

from __future__ import annotations

import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from miles.errors import ConfigError
from miles_envs.sessions.checkpoints import Checkpoint, ExpertRow, Plan, expert_shape, make_checkpoint
from miles_envs.sessions.errors import (
    AbortedBranch,
    EmptyTurn,
    HistoryDiverged,
    MessageError,
    SessionBusy,
    SessionClosed,
    SessionConflict,
    SessionFull,
    SessionNotFound,
    StalePlan,
    TruncatedBranch,
)
from miles_envs.sessions.matchers import CheckedMatcher, Matcher, checked, differences, strict
from miles_envs.sessions.messages import Message, equal_prefix, message_list, replay_key

SessionMode = Literal["linear", "branching"]
LeafSelection = Literal["drop_retries", "all"]

# The replay key of a recorded message the agent has not resent in an accepted form yet: no
# request message equals it (a bare object is equal to itself only).
_UNSEEN: Any = object()


@dataclass(frozen=True, eq=False)
class _Request:
    """A request's messages as sent (``raw``) and parsed (reused where a replay was recognised)."""

    raw: list[Any]
    messages: tuple[Message, ...]


@dataclass(frozen=True, eq=False)
class _LinearRequest(_Request):
    fresh: list[int]  # the places parsed now, in order: only these need the matcher


@dataclass(frozen=True, eq=False)
class _BranchingRequest(_Request):
    recognised: list[Checkpoint]  # checkpoints whose whole path is a recognised replay
    frontier: list[Checkpoint]  # roots and children of those that are not: the matcher decides


class Session(ABC):
    """What both rules share: plan / commit / abandon, the lock, limits and closing."""

    mode: ClassVar[str]

    def __init__(
        self, session_id: str | None = None, *, matcher: Matcher = strict, max_checkpoints: int = 1024
    ) -> None:
        if max_checkpoints < 1:
            raise ValueError("max_checkpoints must be at least 1")
        self.id = session_id or uuid.uuid4().hex
        self.matcher: CheckedMatcher = checked(matcher)
        self.max_checkpoints = max_checkpoints
        self._lock = threading.Lock()
        self._closed = False
        self._created = 0  # checkpoints made so far (their ids)
        self._experts: tuple[bool, tuple[int, int] | None] | None = None  # (present, shape) once known

    # ------------------------------------------------------------------------ public

    @property
    def closed(self) -> bool:
        return self._closed

    def plan(self, messages: Sequence[Mapping[str, Any] | Message]) -> Plan:
        """Decide which checkpoint ``messages`` (the request's whole list) extends.

        Raises ``MessageError`` for malformed messages and a ``SessionConflict`` subclass when
        the session refuses the request; nothing changes in either case (the replay cache aside).
        """
        raw = message_list(messages)
        if not raw:
            raise MessageError("a request needs at least one message")
        with self._lock:
            request = self._read(raw)  # parses what it does not recognise: malformed input fails first
            self._check_open()
            if self._created >= self.max_checkpoints:
                raise self._full()
            plan = self._plan(request)
            self._register(plan)
            return plan

    def commit(
        self,
        plan: Plan,
        *,
        prompt_suffix_ids: Sequence[int],
        output_ids: Sequence[int],
        output_logprobs: Sequence[float],
        weight_versions: Sequence[int],
        finish_reason: str,
        assistant_message: Message | Mapping[str, Any],
        weight_version: int | None = None,
        routed_experts: list[ExpertRow] | None = None,
        suffix_routed_experts: list[ExpertRow] | None = None,
    ) -> Checkpoint:
        """Record the generation answering ``plan`` and return its checkpoint.

        ``prompt_suffix_ids``: the tokens the server appended to ``plan.prefix_ids`` before
        generating (first turn: the whole rendered prompt). ``output_ids`` /
        ``output_logprobs`` / ``weight_versions``: per generated token, as the engine returned
        them. ``finish_reason``: stop, tool_calls, length or abort. ``assistant_message``: the
        reply the server parsed from the output (what the agent will replay). ``weight_version``:
        the engine's version, needed only when no token was generated. ``routed_experts``: per
        output token, the experts of the forward pass that produced it (``[layer][k]``; what
        ``GenerateOutput.routed_experts`` holds). ``suffix_routed_experts``: optionally the same
        per suffix token (the engine's rows for the suffix positions, each shifted by one);
        without them the trajectory carries ``-1`` rows there (route freshly).

        Raises ``ValueError`` for inconsistent results (nothing is recorded), ``StalePlan`` for
        a plan already committed or abandoned, ``SessionClosed`` if the session was deleted
        meanwhile.
        """
        with self._lock:
            self._check_plan(plan)
            if self._closed:
                self._unregister(plan)
                raise SessionClosed(f"session {self.id} was deleted while this request was generating")
            if self._created >= self.max_checkpoints:  # concurrent branching plans can race to the cap
                self._unregister(plan)
                raise self._full()
            # A ValueError here leaves the plan open: the caller may commit corrected results or abandon it.
            checkpoint = make_checkpoint(
                id=self._created,
                parent=plan.parent,
                new_messages=plan.new_messages,
                prompt_suffix_ids=prompt_suffix_ids,
                output_ids=output_ids,
                output_logprobs=output_logprobs,
                weight_versions=weight_versions,
                finish_reason=finish_reason,
                assistant_message=assistant_message,
                weight_version=weight_version,
                routed_experts=routed_experts,
                suffix_routed_experts=suffix_routed_experts,
            )
            self._check_experts(checkpoint)
            self._created += 1
            self._unregister(plan)
            self._attach(plan, checkpoint)
            return checkpoint

    def abandon(self, plan: Plan) -> None:
        """Forget a plan that will not be committed (the engine failed...). Idempotent."""
        with self._lock:
            self._unregister(plan)

    @contextmanager
    def turn(self, messages: Sequence[Mapping[str, Any] | Message]) -> Iterator[Plan]:
        """``plan`` on entry; on exit, a plan that was not committed is abandoned.

        Works around an ``await``: the session lock is not held inside the block.
        """
        plan = self.plan(messages)
        try:
            yield plan
        finally:
            self.abandon(plan)

    def close(self) -> None:
        """Refuse further requests; a generation in flight will not be recorded. Reads still work."""
        with self._lock:
            self._closed = True

    @abstractmethod
    def trajectories(self, selection: LeafSelection = "drop_retries") -> list[list[Checkpoint]]:
        """The checkpoint paths that become training sequences (root first), oldest leaf first."""

    @abstractmethod
    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint recorded, in creation order (including retried / unselected ones)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for logs and for the sample metadata."""

    # ------------------------------------------------------------------- subclasses

    @abstractmethod
    def _read(self, raw: list[Any]) -> _Request:
        """Parse ``raw``, reusing the parse of every replay recognised (under the lock)."""

    @abstractmethod
    def _plan(self, request: Any) -> Plan:
        """Where the request from ``_read`` attaches (under the lock); a ``SessionConflict`` refuses it."""

    @abstractmethod
    def _register(self, plan: Plan) -> None:
        """Remember ``plan`` as open (under the lock)."""

    @abstractmethod
    def _unregister(self, plan: Plan) -> None:
        """Forget ``plan`` if it is open (under the lock)."""

    @abstractmethod
    def _is_open(self, plan: Plan) -> bool:
        """Whether ``plan`` may still be committed (under the lock)."""

    @abstractmethod
    def _attach(self, plan: Plan, checkpoint: Checkpoint) -> None:
        """Add the committed checkpoint to the history (under the lock)."""

    # ---------------------------------------------------------------------- helpers

    def _full(self) -> SessionFull:
        return SessionFull(
            f"session {self.id} holds {self._created} checkpoints, its maximum (max_checkpoints); "
            "start a new session"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.id} was deleted")

    def _check_plan(self, plan: Plan) -> None:
        if plan.session_id != self.id or not self._is_open(plan):
            raise StalePlan(
                f"this plan is not open in session {self.id}: it was committed or abandoned already, "
                "or it belongs to another session"
            )

    def _check_experts(self, checkpoint: Checkpoint) -> None:
        """Routed experts are recorded for every turn or for none, with one shape."""
        present = checkpoint.routed_experts is not None
        shape = expert_shape(checkpoint.routed_experts) or expert_shape(checkpoint.suffix_routed_experts)
        if checkpoint.suffix_routed_experts is not None and not present:
            raise ValueError("suffix_routed_experts given without routed_experts")
        if self._experts is None:
            self._experts = (present, shape)
            return
        was_present, known = self._experts
        if present != was_present:
            raise ValueError(
                f"routed_experts {'given' if present else 'missing'} for this turn but "
                f"{'given' if was_present else 'missing'} for earlier turns of session {self.id}: "
                "they are recorded for every turn (R3 on) or none"
            )
        if shape is not None and known is not None and shape != known:
            raise ValueError(
                f"routed_experts shape {shape} (layers, top-k) differs from earlier turns' {known}"
            )
        if known is None:
            self._experts = (present, shape)

    def _refuse_dead_end(self, checkpoint: Checkpoint, index: int) -> None:
        if checkpoint.truncated:
            raise TruncatedBranch(
                f"session {self.id}: the request extends turn {checkpoint.depth} (messages up to {index - 1}), "
                "whose generation stopped at the length limit, so its reply is cut off and the trajectory "
                "is over (reported as truncated); retry that turn instead, or raise max_tokens",
                index=index,
            )
        if checkpoint.aborted:
            raise AbortedBranch(
                f"session {self.id}: the request extends turn {checkpoint.depth} (messages up to {index - 1}), "
                "whose generation the engine aborted; retry that turn instead",
                index=index,
            )

    def _empty_turn(self, upto: int) -> EmptyTurn:
        return EmptyTurn(
            f"session {self.id}: the request is the recorded history up to message {upto - 1} (an assistant "
            "reply) and adds no message after it, so there is nothing to answer",
            index=upto,
        )


class LinearSession(Session):
    """One growing sequence; retrying the most recent turn replaces it; earlier divergence is refused."""

    mode = "linear"

    def __init__(
        self, session_id: str | None = None, *, matcher: Matcher = strict, max_checkpoints: int = 1024
    ) -> None:
        super().__init__(session_id, matcher=matcher, max_checkpoints=max_checkpoints)
        self._chain: list[Checkpoint] = []
        self._path: list[Message] = []  # recorded messages of the chain, kept in step with it
        # The replay cache, in step with _path: at place i, the replay key of the form in which
        # the matcher last accepted a resent _path[i], and that form parsed. Until the agent has
        # resent _path[i] in an accepted form, the key is _UNSEEN (no request message equals it)
        # and the parse slot holds the recorded message itself.
        self._keys: list[Any] = []
        self._replayed: list[Message] = []
        self._known = 0  # _keys[:_known] holds no _UNSEEN
        self._retried: list[Checkpoint] = []
        self._pending: Plan | None = None

    def _read(self, raw: list[Any]) -> _LinearRequest:
        # The recognised run of the history in one comparison; after it (normally just the latest
        # turn's messages), place by place.
        keys = self._keys
        start = equal_prefix(raw, keys[: self._known])
        messages = self._replayed[:start]
        fresh: list[int] = []
        for i in range(start, len(raw)):
            if i < len(keys) and raw[i] == keys[i]:
                messages.append(self._replayed[i])
            else:
                messages.append(Message.from_openai(raw[i], index=i))
                fresh.append(i)
        return _LinearRequest(raw, tuple(messages), fresh)

    def _plan(self, request: _LinearRequest) -> Plan:
        messages = request.messages
        if self._pending is not None:
            raise SessionBusy(
                f"session {self.id} is linear and a request of it is still generating; send the next "
                "turn after that reply (or use a branching session for concurrent requests)"
            )
        if not self._chain:
            return Plan(self.id, None, messages)
        matched = self._matched_prefix(request)
        tail = self._chain[-1]
        if matched == len(self._path):  # the whole recorded path: extend the tail
            if len(messages) == matched:
                raise self._empty_turn(matched)
            self._refuse_dead_end(tail, matched)
            return Plan(self.id, tail, messages)
        if matched >= tail.start:  # diverges inside the most recent turn: retry it
            if len(messages) == tail.start:
                raise self._empty_turn(tail.start)
            return Plan(self.id, tail.parent, messages, replaces=tail)
        raise self._diverged(messages, matched)

    def _matched_prefix(self, request: _LinearRequest) -> int:
        """How many leading request messages replay the recorded path.

        A recognised replay matches without asking the matcher; the others are put to it in order.
        """
        n = min(len(request.messages), len(self._path))
        for i in request.fresh:
            if i >= n:
                break
            if not self.matcher(self._path[i], request.messages[i]):
                return i
            self._remember(i, request.raw[i], request.messages[i])
        return n

    def _remember(self, index: int, raw: Any, message: Message) -> None:
        """The matcher accepted ``raw`` (parsed: ``message``) as the recorded message at ``index``."""
        key = replay_key(raw, message)
        if key is None:
            return
        self._keys[index] = key
        self._replayed[index] = message
        while self._known < len(self._keys) and self._keys[self._known] is not _UNSEEN:
            self._known += 1

    def _diverged(self, messages: tuple[Message, ...], index: int) -> HistoryDiverged:
        turn = next(c for c in self._chain if c.num_messages > index)
        recorded = self._path[index]
        if index >= len(messages):
            what = (
                f"the request ends after message {index - 1}, inside the recorded history "
                f"({len(self._path)} messages; message {index} is a recorded {recorded.role} message)"
            )
        else:
            diff = differences(recorded, messages[index])
            detail = (
                f"differs in {', '.join(diff)}"
                if diff
                else "equal field by field, yet the matcher refused it"
            )
            what = (
                f"message {index} ({messages[index].role}) does not match the recorded {recorded.role} message "
                f"under matcher {self.matcher.label} ({detail})"
            )
        back = len(self._chain) - turn.depth + 1
        return HistoryDiverged(
            f"session {self.id} (linear): {what}. That is in turn {turn.depth} of {len(self._chain)}, so "
            f"answering would roll back {back} turns; a linear session only extends its history or retries "
            "its most recent turn. Use a branching session for harnesses that fork or rewrite their "
            "context, or a looser session matcher (json_args) for harnesses that re-serialise tool-call "
            "arguments",
            index=index,
        )

    def _register(self, plan: Plan) -> None:
        self._pending = plan

    def _unregister(self, plan: Plan) -> None:
        if self._pending is plan:
            self._pending = None

    def _is_open(self, plan: Plan) -> bool:
        return self._pending is plan

    def _attach(self, plan: Plan, checkpoint: Checkpoint) -> None:
        if plan.replaces is not None:
            # The chain cannot have moved: no other plan could be committed while this one was open.
            assert self._chain and self._chain[-1] is plan.replaces
            self._retried.append(self._chain.pop())
        start, turn = checkpoint.start, checkpoint.turn_messages
        del self._path[start:], self._keys[start:], self._replayed[start:]
        self._known = min(self._known, start)
        self._chain.append(checkpoint)
        self._path += turn
        # Not keyed yet: the recorded message is the request's own parse here, and only the matcher
        # (which need not accept a message as itself) can say that a resent form replays it.
        self._keys += [_UNSEEN] * len(turn)
        self._replayed += turn

    def trajectories(self, selection: LeafSelection = "drop_retries") -> list[list[Checkpoint]]:
        with self._lock:
            return [list(self._chain)] if self._chain else []

    def checkpoints(self) -> list[Checkpoint]:
        with self._lock:
            return sorted([*self._chain, *self._retried], key=lambda c: c.id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "mode": self.mode,
                "turns": len(self._chain),
                "checkpoints": self._created,
                "retried_turns": len(self._retried),
                "tokens": self._chain[-1].num_tokens if self._chain else 0,
            }


class BranchingSession(Session):
    """An append-only tree of checkpoints; each selected leaf is one training sequence."""

    mode = "branching"

    def __init__(
        self, session_id: str | None = None, *, matcher: Matcher = strict, max_checkpoints: int = 1024
    ) -> None:
        super().__init__(session_id, matcher=matcher, max_checkpoints=max_checkpoints)
        self._all: list[Checkpoint] = []
        self._children: dict[int | None, list[Checkpoint]] = {None: []}  # parent id -> children
        self._pending: set[Plan] = set()
        # The replay cache, per checkpoint id: the replay keys of the form in which the matcher
        # last accepted the checkpoint's turn messages, resent, and that form parsed.
        self._keys: dict[int, list[Any]] = {}
        self._replayed: dict[int, tuple[Message, ...]] = {}

    def _read(self, raw: list[Any]) -> _BranchingRequest:
        # Walk down the checkpoints whose turn is a recognised replay; where recognition stops,
        # the matcher takes over in _deepest_prefix (each checkpoint is looked at once in all).
        recognised: list[Checkpoint] = []
        frontier: list[Checkpoint] = []
        stack = list(self._children[None])
        while stack:
            node = stack.pop()
            if self._recognised(node, raw):
                recognised.append(node)
                stack += self._children[node.id]
            else:
                frontier.append(node)
        deepest = max(recognised, key=_depth_order, default=None)
        messages: list[Message] = []
        for node in deepest.path() if deepest is not None else ():
            messages += self._replayed[node.id]
        messages += (Message.from_openai(raw[i], index=i) for i in range(len(messages), len(raw)))
        return _BranchingRequest(raw, tuple(messages), recognised, frontier)

    def _plan(self, request: _BranchingRequest) -> Plan:
        messages = request.messages
        parent = self._deepest_prefix(request)
        if parent is None:
            return Plan(self.id, None, messages)
        if parent.num_messages == len(messages):
            raise self._empty_turn(len(messages))
        self._refuse_dead_end(parent, parent.num_messages)
        return Plan(self.id, parent, messages)

    def _deepest_prefix(self, request: _BranchingRequest) -> Checkpoint | None:
        """The checkpoint matching the most messages (newest on ties) whose whole path matches.

        A checkpoint whose turn matches only partly is not a candidate, nor is anything below it.
        The recognised replays match; the walk goes on from the frontier ``_read`` left.
        """
        best = max(request.recognised, key=_depth_order, default=None)
        stack = list(request.frontier)
        while stack:
            node = stack.pop()
            if not (self._recognised(node, request.raw) or self._matches(node, request)):
                continue
            if best is None or _depth_order(node) > _depth_order(best):
                best = node
            stack += self._children[node.id]
        return best

    def _recognised(self, node: Checkpoint, raw: list[Any]) -> bool:
        """Whether ``raw`` resends ``node``'s turn in the form the matcher accepted last time."""
        key = self._keys.get(node.id)
        return (
            key is not None and node.num_messages <= len(raw) and raw[node.start : node.num_messages] == key
        )

    def _matches(self, node: Checkpoint, request: _BranchingRequest) -> bool:
        """Ask the matcher about ``node``'s turn; remember the replay it accepts."""
        start, end = node.start, node.num_messages
        if end > len(request.messages):
            return False
        incoming = request.messages[start:end]
        if not all(self.matcher(m, x) for m, x in zip(node.turn_messages, incoming, strict=True)):
            return False
        keys = [replay_key(r, m) for r, m in zip(request.raw[start:end], incoming, strict=True)]
        if None not in keys:
            self._keys[node.id] = keys
            self._replayed[node.id] = incoming
        return True

    def _register(self, plan: Plan) -> None:
        self._pending.add(plan)

    def _unregister(self, plan: Plan) -> None:
        self._pending.discard(plan)

    def _is_open(self, plan: Plan) -> bool:
        return plan in self._pending

    def _attach(self, plan: Plan, checkpoint: Checkpoint) -> None:
        self._all.append(checkpoint)
        self._children.setdefault(plan.parent.id if plan.parent else None, []).append(checkpoint)
        self._children[checkpoint.id] = []

    def leaves(self) -> list[Checkpoint]:
        """Checkpoints nothing extends, oldest first."""
        with self._lock:
            return [c for c in self._all if not self._children[c.id]]

    def trajectories(self, selection: LeafSelection = "drop_retries") -> list[list[Checkpoint]]:
        """One path per selected leaf, oldest leaf first.

        ``drop_retries`` (default) leaves out a leaf when a checkpoint on its path was retried:
        a later sibling (same parent) was generated for the same new messages, which is how a
        harness retries a turn. ``all`` keeps every leaf.
        """
        if selection not in ("drop_retries", "all"):
            raise ConfigError(f"leaf selection must be 'drop_retries' or 'all', got {selection!r}")
        with self._lock:
            leaves = [c for c in self._all if not self._children[c.id]]
            retried = self._retried_ids() if selection == "drop_retries" else set()
            paths = [leaf.path() for leaf in leaves]
            return [p for p in paths if not any(c.id in retried for c in p)]

    def _retried_ids(self) -> set[int]:
        retried: set[int] = set()
        for siblings in self._children.values():
            for i, node in enumerate(siblings):
                if any(self._same_turn_input(node, later) for later in siblings[i + 1 :]):
                    retried.add(node.id)
        return retried

    def _same_turn_input(self, a: Checkpoint, b: Checkpoint) -> bool:
        return len(a.new_messages) == len(b.new_messages) and all(
            self.matcher(x, y) for x, y in zip(a.new_messages, b.new_messages, strict=True)
        )

    def checkpoints(self) -> list[Checkpoint]:
        with self._lock:
            return list(self._all)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            leaves = sum(1 for c in self._all if not self._children[c.id])
            return {
                "mode": self.mode,
                "checkpoints": self._created,
                "leaves": leaves,
                "roots": len(self._children[None]),
                "max_depth": max((c.depth for c in self._all), default=0),
                "in_flight": len(self._pending),
            }


def _depth_order(node: Checkpoint) -> tuple[int, int]:
    """Deeper first (more messages matched), then newer."""
    return node.num_messages, node.id


SESSION_CLASSES: dict[str, type[Session]] = {"linear": LinearSession, "branching": BranchingSession}


class SessionStore:
    """The sessions of one server, by id: create, get, delete (thread-safe)."""

    def __init__(
        self,
        *,
        mode: SessionMode = "linear",
        matcher: Matcher = strict,
        max_checkpoints: int = 1024,
        max_sessions: int | None = None,
    ) -> None:
        if mode not in SESSION_CLASSES:
            raise ConfigError(f"session mode must be 'linear' or 'branching', got {mode!r}")
        if max_sessions is not None and max_sessions < 1:
            raise ConfigError(f"max_sessions must be at least 1, got {max_sessions}")
        if max_checkpoints < 1:
            raise ConfigError(f"max_checkpoints must be at least 1, got {max_checkpoints}")
        self.mode = mode
        self.matcher = checked(matcher)
        self.max_checkpoints = max_checkpoints
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, session_id: str | None = None) -> Session:
        session = SESSION_CLASSES[self.mode](
            session_id, matcher=self.matcher, max_checkpoints=self.max_checkpoints
        )
        with self._lock:
            if session.id in self._sessions:
                raise SessionConflict(f"a session with id {session.id!r} exists already")
            if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
                raise SessionFull(
                    f"the store holds {len(self._sessions)} sessions, its maximum (max_sessions); "
                    "delete finished sessions"
                )
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (never created, or deleted)")
        return session

    def delete(self, session_id: str) -> Session:
        """Remove and close a session; returns it so its trajectories can still be read."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (never created, or deleted)")
        session.close()
        return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions
