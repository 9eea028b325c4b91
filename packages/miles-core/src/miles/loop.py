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
from miles.driver.components import Components, build_components
from miles.driver.generation import RolloutStage, SyncGeneration
from miles.driver.services import (
    check_engine_versions,
    describe_update,
    offloaded_while,
    placement_session,
    rollout_engines,
    served_teacher,
    trainer,
)
from miles.driver.sft import SFTStage
from miles.driver.training import make_train_batch
from miles.interfaces import RolloutContext
from miles.plugins import get_plugin_manager
from miles.run_dir import LoopState, RunDir
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
    from miles.models.registry import resolve_model

    t_start = time.perf_counter()
    # The rich console owns the terminal; library progress bars (here and in the engine and
    # rank processes, which inherit the environment) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    pm = get_plugin_manager()
    hooks = pm.hook
    # Plugins see (and may refuse) the config before anything is written or started.
    hooks.miles_configure.call_historic(kwargs={"config": config})
    run = RunDir(config.run_dir)
    run.check(resume=resume, overwrite=overwrite)
    # Bad models and datasets fail here, before the run directory is touched.
    model_path = resolve_model(config.model.path)
    components = build_components(config, model_path, hooks)
    rl = config.mode == "rl"
    run.prepare(resume=resume, overwrite=overwrite)
    with open(run.sub("config.yaml"), "w", encoding="utf-8") as f:
        f.write(dump_config(config))

    checkpoint = run.latest_checkpoint() if resume else None
    state = RunDir.read_state(checkpoint) if checkpoint else LoopState()
    if checkpoint:
        components.data_source.load_state_dict(state.data_source)
        truncate_after(run.sub("metrics.jsonl"), state.step - 1)

    loop = asyncio.new_event_loop()
    status = "failed"
    engines: list = []
    # Held while the engines' weights change; a shared-engine evaluation holds it while it measures.
    weights_lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        sessions = [components.reward, *components.reward_postprocess]
        stack.callback(lambda: loop.run_until_complete(_close_clients([*engines, *sessions])))
        trackers = _start_trackers(config, run, state.step, pm, stack)
        console = trackers.get("console")
        stack.enter_context(placement_session(config))
        engine_urls: list[str] = []
        transport_options: dict = {}
        if rl:
            engine_urls, transport_options = stack.enter_context(
                rollout_engines(config, model_path, run.sub("engines"), run.path)
            )
        backend = stack.enter_context(
            trainer(config, model_path, components.objective, engine_urls, transport_options, pm)
        )
        engines.extend(_engine_clients(engine_urls))
        if checkpoint:
            backend.load_checkpoint(os.path.join(checkpoint, "trainer"))
            if rl and state.weight_version > 0:
                backend.update_weights(state.weight_version)
                check_engine_versions(loop, engines, state.weight_version)
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
            generation = _generation(config, components, ctx, engines, loop, hooks, console, state.step)
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
                            stats = backend.update_weights(version)
                            check_engine_versions(loop, engines, version)
                        hooks.miles_on_weights_updated(version=version, stats=stats)
                        metrics |= describe_update(stats)
                    # evaluate when due; finished evaluations are logged against the step they measured
                    if eval_due:
                        evaluator.start(step)
                    _log_evaluations(evaluator, step, hooks)
                metrics["time/step_s"] = time.perf_counter() - t_step
                hooks.miles_on_metrics(step=step, metrics=metrics)
            if rl and evaluator is not None:  # wait for the evaluations still running, then log them
                eval_stack.close()
                _log_evaluations(evaluator, config.run.num_steps - 1, hooks)
            final_dir = None
            if config.run.export_hf:
                final_dir = run.sub("final")
                backend.export_hf(final_dir)
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            hooks.miles_on_run_end(run_dir=run.path, status=status)
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
    engines: list,
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
    urls = [e.url for e in engines]

    def worker_context() -> RolloutContext:  # built on the worker's loop: its clients belong to it
        # The console's per-rollout progress bar has no meaning when rollouts never end.
        return dataclasses.replace(ctx, engines=_engine_clients(urls), router=None, on_sample_done=None)

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
        engines,
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


def _engine_clients(urls: list[str]) -> list:
    from miles.engines.client import SGLangClient

    return [SGLangClient(url) for url in urls]


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

        trackers["tensorboard"] = TensorBoardTracker(run.sub("tensorboard"))
    if t.console:
        from miles.tracking.console import ConsoleTracker

        trackers["console"] = ConsoleTracker(config.run.num_steps, first_step, t.log_samples)
    for name, tracker in trackers.items():
        pm.register(tracker, name=f"tracker:{name}")
        stack.callback(tracker.close)
        stack.callback(pm.unregister, tracker)
    return trackers
