"""Token-in-token-out sessions, without HTTP and without an engine.

A session records, turn by turn, the exact tokens an agent's conversation became (the
server renders and tokenizes; the engine generates) and decides which recorded turn a new
request extends. ``messages`` normalises chat messages, ``matchers`` decides whether a
replayed message is the recorded one, ``store`` holds linear and branching sessions,
``trajectory`` turns a session into training samples, ``safety`` holds the run-level rule.
See docs/sessions.md.
"""

from __future__ import annotations

from miles_envs.sessions.checkpoints import FINISH_REASONS, Checkpoint, Plan
from miles_envs.sessions.errors import (
    AbortedBranch,
    EmptyTurn,
    HistoryDiverged,
    MatcherError,
    MessageError,
    SessionBusy,
    SessionClosed,
    SessionConflict,
    SessionError,
    SessionFull,
    SessionNotFound,
    StalePlan,
    TruncatedBranch,
)
from miles_envs.sessions.matchers import BUILTIN_MATCHERS, Matcher, json_args, loose, resolve_matcher, strict
from miles_envs.sessions.messages import Message, ToolCall, parse_messages
from miles_envs.sessions.safety import SESSION_UPDATE_MODES, check_update_mode
from miles_envs.sessions.store import BranchingSession, LinearSession, Session, SessionStore
from miles_envs.sessions.trajectory import assemble, session_samples, trajectory_status

__all__ = [
    "BUILTIN_MATCHERS",
    "FINISH_REASONS",
    "SESSION_UPDATE_MODES",
    "AbortedBranch",
    "BranchingSession",
    "Checkpoint",
    "EmptyTurn",
    "HistoryDiverged",
    "LinearSession",
    "Matcher",
    "MatcherError",
    "Message",
    "MessageError",
    "Plan",
    "Session",
    "SessionBusy",
    "SessionClosed",
    "SessionConflict",
    "SessionError",
    "SessionFull",
    "SessionNotFound",
    "SessionStore",
    "StalePlan",
    "ToolCall",
    "TruncatedBranch",
    "assemble",
    "check_update_mode",
    "json_args",
    "loose",
    "parse_messages",
    "resolve_matcher",
    "session_samples",
    "strict",
    "trajectory_status",
]
