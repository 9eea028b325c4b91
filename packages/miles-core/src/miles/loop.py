"""The driver: one loop for RL and SFT, both schedules, readable as pseudocode.

    check everything, decide where to start, write the run directory     (driver/start.py)
    RL with a warm start: run its SFT stage first, start from its policy   (driver/warm_start.py)
    open the run's services: trackers, engines, trainer, generation       (driver/session.py)
    for each step:
        batch   = next batch      # RL: generate (or take from the buffer) -> scores -> advantages
                                  # SFT: next conversations -> assistant-token loss masks
        metrics = train(batch)    # loss (+ correction) -> backend step
        save a checkpoint when one is due
        RL: update the engines' weights when due; evaluate when due
        log the step; stop here if a signal asked to
    finish: wait for evaluations and export, or (after a signal) save what is done

Under ``schedule: sync`` generation and training take turns (a colocated placement
offloads the trainer while the engines generate). Under ``schedule: fully_async`` a
background worker keeps the engines generating into a bounded, staleness-checked
buffer, and a weight update pauses the engines only for the reload itself.
Everything else (which engine, which backend, which loss) lives behind those calls
and is chosen by the recipe. SFT (``mode: sft``) starts no engine at all.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from miles.config.schema import MilesConfig
from miles.driver.hooks import Hooks
from miles.driver.interrupts import StopRequest, stopped_by_signal
from miles.driver.session import Session
from miles.driver.start import start_run
from miles.driver.warm_start import run_warm_start
from miles.plugins import get_plugin_manager
from miles.tracking.summaries import write_run_summaries
from miles.tracking.timing import step_clock


@dataclass
class RunResult:
    run_dir: str
    steps_done: int
    metrics_path: str
    final_dir: str | None
    checkpoint: str | None
    seconds: float


def train(config: MilesConfig, *, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Run the recipe's loop; returns where its results are."""
    t_start = time.perf_counter()
    # The rich console owns the terminal; library progress bars (here and in the engine and
    # rank processes, which inherit the environment) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    pm = get_plugin_manager()
    start = start_run(config, resume=resume, overwrite=overwrite, hooks=Hooks(pm))
    if config.warm_start is not None:  # a supervised stage first; RL starts from its final policy
        start.model_path = run_warm_start(config, start.run, resume=resume)
        Hooks(pm).miles_configure(config=config)  # plugins configured by the stage: back to this run
    stop = StopRequest()
    state, final_dir = start.state, None
    with Session(config, start, stop, pm) as run:
        run.begin()
        try:
            for step in range(start.state.step, config.run.num_steps):
                t_step = time.perf_counter()
                with step_clock() as clock:  # every phase below is timed (miles.tracking.timing)
                    todo = run.next_batch(step)
                    metrics = todo.metrics | run.train(step, todo.batch)
                    state = run.state_after(step)
                    run.save_when_due(step, state)
                    metrics |= run.update_weights_when_due(step)
                    run.evaluate_when_due(step)
                step_s = time.perf_counter() - t_step
                # The driver's clock has the last word on a phase's time (a component may report its own).
                metrics |= clock.metrics(step_s)
                metrics["time/step_s"] = step_s
                run.log(step, metrics, todo.prompts)
                if stop.requested:
                    break
            final_dir = run.finish(state)
        except KeyboardInterrupt:
            run.status = "interrupted"
            raise
        finally:
            run.end()
            write_run_summaries(config, start.run.path)  # the time table and the learning curves
    if run.status == "interrupted" and stop.signum is not None:
        raise stopped_by_signal(stop.signum, state.step, config.run.num_steps, run.checkpoint)
    return RunResult(
        run_dir=start.run.path,
        steps_done=state.step,
        metrics_path=start.run.sub("metrics.jsonl"),
        final_dir=final_dir,
        checkpoint=run.checkpoint,
        seconds=time.perf_counter() - t_start,
    )
