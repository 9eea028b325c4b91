"""Stopping a run on SIGINT / SIGTERM at a safe point instead of wherever the signal lands.

Once the loop runs, the first signal only asks: the driver finishes the step it is in,
saves a checkpoint (when checkpoints are on) and stops, so ``--resume`` loses nothing.
A second signal, or any signal during start-up, stops at once (``SignalInterrupt``, a
``KeyboardInterrupt``); the run's context managers still stop every process it started. The engines and trainer ranks ignore the terminal's Ctrl-C (they
share its process group): only the driver decides when they stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from miles.errors import RunInterrupted

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalInterrupt(KeyboardInterrupt):
    """A stop-at-once by SIGINT or SIGTERM; ``signum`` says which (the exit code follows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """Set by the first SIGINT/SIGTERM while ``installed`` and ``graceful``; otherwise the signal stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.graceful = False  # the driver sets it once the step loop runs

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread; keep Python's default
            return
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None or not self.graceful:
            self.signum = self.signum or signum
            raise SignalInterrupt(signum)
        self.signum = signum
        log.warning(
            "%s: stopping after the current step (send it again, e.g. Ctrl-C, to stop at once)",
            signal.Signals(signum).name,
        )


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130, 143)."""
    return 128 + signum


def stopped_by_signal(signum: int, steps_done: int, num_steps: int, checkpoint: str | None) -> RunInterrupted:
    """The error the driver raises after a signal stopped it at a safe point."""
    import os

    name = signal.Signals(signum).name
    saved = (
        f"checkpoint {os.path.basename(checkpoint)} holds it"
        if checkpoint is not None
        else "no checkpoint holds it (run.save_every is unset)"
    )
    return RunInterrupted(
        f"{name}: stopped after step {steps_done} of {num_steps}; {saved}",
        signum=signum,
        steps_done=steps_done,
        checkpoint=checkpoint,
    )
