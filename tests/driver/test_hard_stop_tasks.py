"""A hard stop (the second SIGINT/SIGTERM) raises ``SignalInterrupt`` in whatever the driver's loop
runs; a task it lands in keeps it as its exception. That stop is reported once, in one line: the
driver loop's exception handler keeps asyncio from printing the task's traceback again at exit,
and reports every other unretrieved exception as asyncio does."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable

import pytest

from miles.driver.interrupts import SignalInterrupt
from miles.driver.session import _quiet_hard_stop


def _leave_a_failed_task(loop: asyncio.AbstractEventLoop, make: Callable[[], BaseException]) -> None:
    async def fail() -> None:
        raise make()  # made here: an instance raised before would keep its traceback, and the task, alive

    task = loop.create_task(fail())
    left = False
    try:  # a KeyboardInterrupt leaves the loop at once, as a hard stop does
        loop.run_forever()
    except KeyboardInterrupt:
        left = True  # (no pytest.raises: its record would keep the traceback, and so the task, alive)
    assert left and task.done()
    del task
    gc.collect()


@pytest.mark.parametrize(
    ("make", "reported"), [(lambda: SignalInterrupt(signal.SIGTERM), False), (KeyboardInterrupt, True)]
)
def test_only_the_hard_stops_interrupt_is_kept_quiet(caplog, make, reported):
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_quiet_hard_stop)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            _leave_a_failed_task(loop, make)
    finally:
        loop.close()
    assert ("Task exception was never retrieved" in caplog.text) is reported, caplog.text
