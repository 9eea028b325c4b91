"""The driver: one loop for both schedules, readable as pseudocode.

    for each step:
        RL:  groups = generation.collect(step)  # sync: generate now; fully_async: take from the buffer
             batch  = make_train_batch(groups)  # scores on the trainer -> advantages (+ distillation)
        SFT: batch  = next conversations        # data source -> assistant-token loss masks
        metrics = train(step, batch)            # loss (+ correction) -> backend step
        save a checkpoint when one is due
        RL:  update the engines' weights when due   # transport; engines serve version step+1
             evaluate when due; log finished evaluations
        log the step

Under ``schedule: sync`` generation and training take turns (a colocated placement
offloads the trainer while the engines generate). Under ``schedule: fully_async`` a
background worker keeps the engines generating into a bounded, staleness-checked
buffer, and a weight update pauses the engines only for the reload itself.
Everything else (which engine, which backend, which loss) lives behind those calls
and is chosen by the recipe. SFT (``mode: sft``) starts no engine at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

from miles.config.schema import MilesConfig
from miles.driver.agentic import fleet_dp_sizes, session_server
from miles.driver.components import Components
from miles.driver.fleet import EngineFleet, engine_fleet
from miles.driver.generation import RolloutStage, SyncGeneration
from miles.driver.interrupts import StopRequest, stopped_by_signal
from miles.driver.preflight import preflight
from miles.driver.resume import resume_point
from miles.driver.services import (
    describe_update,
    offloaded_while,
    placement_session,
    served_teacher,
    trainer,
)
from miles.driver.sft import SFTStage
from miles.driver.training import make_train_batch
from miles.interfaces import RolloutContext
from miles.plugins import get_plugin_manager
from miles.run_dir import TRAINED_PROMPTS, LoopState, RunDir
from miles.tracking.jsonl import JsonlTracker, truncate_after
from miles.types import SamplingParams

log = logging.getLogger(__name__)


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
    from miles.config import dump_config

    t_start = time.perf_counter()
    # The rich console owns the terminal; library progress bars (here and in the engine and
    # rank processes, which inherit the environment) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    pm = get_plugin_manager()
    hooks = pm.hook
    run = RunDir(config.run_dir, config.run.output_dir)
    run.check(resume=resume, overwrite=overwrite)
    # Everything `miles config validate --check` checks (plugins' refusals, model, data, components,
    # ports) fails here, before the run directory is touched.
    checked = preflight(config, hooks)
    model_path, components = checked.model_path, checked.components
    rl = config.mode == "rl"
    # A resume that would change what the checkpoint means is refused here, also before any write.
    checkpoint, state, changes = (
        resume_point(run, config, components.data_source) if resume else (None, LoopState(), {})
    )
    run.prepare(resume=resume, overwrite=overwrite)
    if checkpoint:
        run.keep_config_history()
        run.record_resume(checkpoint, {k: list(v) for k, v in changes.items()})
        for path in (run.sub("metrics.jsonl"), run.sub(TRAINED_PROMPTS)):
            truncate_after(path, state.step - 1)  # the resumed run redoes the steps after the checkpoint
    with open(run.sub("config.yaml"), "w", encoding="utf-8") as f:
        f.write(dump_config(config))
    stop = StopRequest()

    loop = asyncio.new_event_loop()
    status = "failed"
    engines: list = []
    # Held while the engines' weights change; a shared-engine evaluation holds it while it measures.
    weights_lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        # Last of all (engines stopped): the marker says how the run ended, start-up failures included.
        stack.callback(lambda: run.update_marker(status=status))
        stack.callback(loop.close)
        stack.callback(_cancel_pending, loop)  # a hard stop leaves tasks behind: end them quietly
        stack.enter_context(stop.installed())
        sessions = [components.reward, *components.reward_postprocess]
        stack.callback(lambda: loop.run_until_complete(_close_clients([*engines, *sessions])))
        trackers = _start_trackers(config, run, state.step, pm, stack)
        console = trackers.get("console")
        stack.enter_context(placement_session(config))
        engine_urls: list[str] = []
        transport_options: dict = {}
        if rl:  # launched (or attached) and supervised: a dead or hung engine is restarted
            fleet = stack.enter_context(engine_fleet(config, model_path, run.sub("engines"), run.path))
            engine_urls, transport_options = fleet.urls, fleet.transport_options
        backend = stack.enter_context(
            trainer(config, model_path, components.objective, engine_urls, transport_options, pm)
        )
        engines.extend(fleet.clients() if rl else [])
        if checkpoint:
            backend.load_checkpoint(os.path.join(checkpoint, "trainer"))
            if rl and state.weight_version > 0:
                fleet.update_weights(backend, state.weight_version)  # the checkpoint's weights, checked
        if rl:
            # Sessions stick to one data-parallel rank of an engine that has several.
            dp_sizes = fleet_dp_sizes(engine_urls) if components.agentic is not None else None
            ctx = _rollout_context(config, model_path, engines, components, console, dp_sizes)
            ctx.agentic = stack.enter_context(
                session_server(config, components.agentic, engine_urls, ctx.tokenizer, ctx.sampling, dp_sizes)
            )
            teacher = stack.enter_context(served_teacher(config, ctx.tokenizer, loop, run.sub("teachers")))
            if teacher is not None:
                ctx.scorers.append(teacher)
            generation = _generation(config, components, ctx, fleet, loop, hooks, console, state.step)
            stack.callback(generation.close)
            evaluator = None
            if config.eval is not None:  # its own stack: closed (and drained) right after the last step
                eval_stack = stack.enter_context(contextlib.ExitStack())
                evaluator = eval_stack.enter_context(
                    _evaluator(config, ctx, run, engine_urls, backend, generation, weights_lock, model_path)
                )
        else:
            sft = SFTStage(
                components.data_source,
                _tokenizer(model_path),
                batch_size=config.sft.batch_size,
                max_length=config.sft.max_length,
            )
        hooks.miles_on_run_start(config=config, run_dir=run.path)
        run.update_marker(status="running")
        stop.graceful = True  # from here a first SIGINT/SIGTERM finishes the step, then stops
        try:
            for step in range(state.step, config.run.num_steps):
                t_step = time.perf_counter()
                batch = None
                if rl:  # generate (or take from the buffer), then score and turn the groups into a batch
                    with offloaded_while(config, backend):  # colocated: the trainer leaves the devices
                        groups, metrics = generation.collect(step)
                    if console is not None:
                        console.show_samples(groups)
                    if groups:
                        batch, adv_metrics = make_train_batch(
                            groups, components.objective, backend, step, hooks
                        )
                        metrics |= adv_metrics
                else:
                    batch, metrics = sft.next_batch(step)
                # train
                if batch is not None:
                    metrics |= hooks.miles_train_step(step=step, batch=batch)
                else:
                    metrics["train/skipped"] = 1.0
                # save when due
                state = LoopState(
                    step=step + 1, weight_version=step + 1, data_source=components.data_source.state_dict()
                )
                if _save_due(config, step):
                    checkpoint = _save(run, backend, state, config.run.keep_checkpoints)
                    hooks.miles_on_checkpoint_saved(step=step, directory=checkpoint)
                if rl:
                    # update weights when due: the engines serve version step+1 from then on
                    eval_due = evaluator is not None and evaluator.due(step)
                    if _update_due(config, step) or eval_due:
                        version = state.weight_version
                        with weights_lock, generation.weights_changing(version):
                            stats = fleet.update_weights(backend, version)  # every engine serves it after
                        hooks.miles_on_weights_updated(version=version, stats=stats)
                        metrics |= describe_update(stats)
                    metrics |= fleet.metrics()
                    # evaluate when due; finished evaluations are logged against the step they measured
                    if eval_due:
                        evaluator.start(step)
                    _log_evaluations(evaluator, step, hooks)
                metrics["time/step_s"] = time.perf_counter() - t_step
                if rl:
                    run.record_trained_prompts(step, [g.prompt.index for g in groups])
                hooks.miles_on_metrics(step=step, metrics=metrics)
                run.update_marker(steps_done=step + 1)
                if stop.requested:
                    break
            final_dir = None
            if state.step < config.run.num_steps:  # stopped by a signal: keep what is done resumable
                if config.run.save_every is not None and not _is_checkpoint_of(checkpoint, state.step):
                    checkpoint = _save(run, backend, state, config.run.keep_checkpoints)
                    hooks.miles_on_checkpoint_saved(step=state.step - 1, directory=checkpoint)
                status = "interrupted"
            else:
                if rl and evaluator is not None:  # wait for the evaluations still running, then log them
                    eval_stack.close()
                    _log_evaluations(evaluator, config.run.num_steps - 1, hooks)
                if config.run.export_hf:
                    final_dir = run.sub("final")
                    backend.export_hf(final_dir)
                status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            hooks.miles_on_run_end(run_dir=run.path, status=status)
    if status == "interrupted" and stop.signum is not None:
        raise stopped_by_signal(stop.signum, state.step, config.run.num_steps, checkpoint)
    return RunResult(
        run_dir=run.path,
        steps_done=state.step,
        metrics_path=run.sub("metrics.jsonl"),
        final_dir=final_dir,
        checkpoint=checkpoint,
        seconds=time.perf_counter() - t_start,
    )


# --------------------------------------------------------------------- helpers


def _generation(
    config: MilesConfig,
    components: Components,
    ctx: RolloutContext,
    fleet: EngineFleet,
    loop,
    hooks,
    console,
    first_step: int,
):
    """The schedule's generation side: a synchronous stage, or a started fully asynchronous worker."""
    r = config.rollout
    if config.schedule == "sync":
        stage = RolloutStage(
            components,
            ctx,
            prompts_per_step=r.prompts_per_step,
            max_rounds=r.max_rounds,
            hooks=hooks,
            loop=loop,
        )
        return SyncGeneration(stage, console)
    import dataclasses

    from miles.driver.async_rollout import AsyncGeneration, AsyncRolloutWorker, default_max_inflight

    fa = config.fully_async

    def worker_context() -> RolloutContext:  # built on the worker's loop: its clients belong to it
        # The console's per-rollout progress bar has no meaning when rollouts never end.
        return dataclasses.replace(ctx, engines=fleet.clients(), router=None, on_sample_done=None)

    worker = AsyncRolloutWorker(
        components.rollout_fn,
        worker_context,
        components.data_source,
        components.buffer,
        max_inflight=fa.max_inflight or default_max_inflight(r.prompts_per_step, r.n_samples_per_prompt),
        replacement=fa.replacement,
        postprocess=lambda groups: hooks.miles_rollout_postprocess(groups=groups, step=worker.step),
    )
    worker.set_version(first_step, first_step)
    worker.start()
    return AsyncGeneration(
        worker,
        components.buffer,
        components.drops,
        ctx.engines,
        loop,
        prompts_per_step=r.prompts_per_step,
        update_mode=fa.update_mode,
        take_timeout_s=fa.take_timeout_s,
    )


def _evaluator(
    config: MilesConfig,
    ctx: RolloutContext,
    run: RunDir,
    engine_urls: list[str],
    backend,
    generation,
    weights_lock: threading.Lock,
    model_path: str,
):
    from miles.eval import Evaluator

    pause = getattr(getattr(generation, "worker", None), "pause_production", contextlib.nullcontext)
    return Evaluator(
        config,
        model_path=model_path,
        tokenizer=ctx.tokenizer,
        agentic=ctx.agentic,
        run_dir=run.path,
        engine_urls=engine_urls,
        export_snapshot=backend.export_hf,
        pause_production=pause,
        weights_lock=weights_lock,
    )


def _log_evaluations(evaluator, step: int, hooks) -> None:
    """Finished evaluations, each logged against the step whose weights it measured (delay included)."""
    if evaluator is None:
        return
    for result in evaluator.collect(step):
        hooks.miles_on_eval(step=result.step, metrics=result.as_metrics())


def _update_due(config: MilesConfig, step: int) -> bool:
    if config.schedule == "sync":
        return True  # the next rollout must sample from the weights just trained
    every = config.fully_async.update_every
    return (step + 1) % every == 0 or step + 1 == config.run.num_steps


def _save_due(config: MilesConfig, step: int) -> bool:
    every = config.run.save_every
    last = step + 1 == config.run.num_steps
    return every is not None and ((step + 1) % every == 0 or last)


def _is_checkpoint_of(checkpoint: str | None, step: int) -> bool:
    return checkpoint is not None and RunDir.read_state(checkpoint).step == step


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a hard stop left running on the driver's loop, so nothing complains at exit."""
    if loop.is_closed():
        return
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _save(run: RunDir, backend: object, state: LoopState, keep: int) -> str:
    staging = run.staging_dir(state.step)
    backend.save_checkpoint(os.path.join(staging, "trainer"))  # type: ignore[attr-defined]
    return run.commit_checkpoint(staging, state.step, state, keep)


async def _close_clients(objects: list) -> None:
    """Close what holds network sessions: engine clients, remote rewards (anything with ``aclose``)."""
    for obj in objects:
        close = getattr(obj, "aclose", None)
        if close is not None:
            await close()


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _rollout_context(
    config: MilesConfig, model_path: str, engines: list, components, console, dp_sizes: list[int] | None
) -> RolloutContext:
    tokenizer = _tokenizer(model_path)
    r = config.rollout
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )
    return RolloutContext(
        engines=engines,
        tokenizer=tokenizer,
        sampling=sampling,
        n_samples_per_prompt=r.n_samples_per_prompt,
        reward=components.reward,
        reward_postprocess=list(components.reward_postprocess),
        options=dict(r.options),
        on_sample_done=console.sample_done if console is not None else None,
        dp_sizes=dp_sizes,
    )


def _start_trackers(
    config: MilesConfig, run: RunDir, first_step: int, pm, stack: contextlib.ExitStack
) -> dict:
    trackers: dict = {}
    t = config.tracking
    if t.jsonl:
        trackers["jsonl"] = JsonlTracker(run.sub("metrics.jsonl"))
    if t.tensorboard:
        from miles.tracking.tensorboard import TensorBoardTracker

        trackers["tensorboard"] = TensorBoardTracker(run.sub("tensorboard"), purge_step=first_step or None)
    if t.console:
        from miles.tracking.console import ConsoleTracker

        trackers["console"] = ConsoleTracker(config.run.num_steps, first_step, t.log_samples)
    for name, tracker in trackers.items():
        pm.register(tracker, name=f"tracker:{name}")
        stack.callback(tracker.close)
        stack.callback(pm.unregister, tracker)
    return trackers
