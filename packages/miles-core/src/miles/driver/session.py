"""A run's services, opened in order and closed in reverse, and the operations the driver's steps call.

Opening a session starts what the recipe asks for: trackers, the Ray session when placement
asks for one, the engine fleet (RL), the trainer's ranks, the rollout context with the
plugins' rollout services and served teachers, the schedule's generation side and the evaluator (RL), or
the supervised stage (SFT). Closing it stops every process the run started, whatever
ended the run. The driver (``miles.loop``) only calls the step operations below.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.capabilities import engine_capabilities
from miles.config.schema import MilesConfig
from miles.driver.fleet import EngineFleet, engine_fleet
from miles.driver.generation import RolloutStage, SyncGeneration
from miles.driver.hooks import Hooks
from miles.driver.interrupts import SignalInterrupt, StopRequest
from miles.driver.rollout_services import fleet_dp_sizes, started_services
from miles.driver.services import (
    describe_update,
    engine_memory_held,
    offloaded_while,
    placement_session,
    served_teacher,
    trainer,
)
from miles.driver.sft import SFTStage
from miles.driver.start import RunStart
from miles.driver.training import make_train_batch
from miles.interfaces import Backend, RolloutContext, SupervisedSampleSource
from miles.plugins import load_component
from miles.routing import records_routing
from miles.run_dir import LoopState, RunDir
from miles.tracking.registry import start_trackers
from miles.tracking.timing import timed
from miles.types import SamplingParams, TrainBatch

if TYPE_CHECKING:
    from types import TracebackType

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """What a step trains on: the batch (None: nothing to train), its metrics, and its prompts."""

    batch: TrainBatch | None
    metrics: dict[str, float]
    prompts: list[int] = field(default_factory=list)  # data-source indices, in batch order


class RLStage:
    """Generate (or take from the buffer), score, and turn the groups into a batch."""

    def __init__(self, session: Session, generation: Any) -> None:
        self.s = session
        self.generation = generation

    def next_batch(self, step: int) -> StepBatch:
        s = self.s
        # Colocated: the trainer leaves the devices (and, with engine.release_memory, the engines hold
        # their KV cache only meanwhile). Timed as rollout: under sync the generation, under
        # fully_async the wait for the buffer.
        with offloaded_while(s.config, s.backend), engine_memory_held(s.config, s.fleet), timed("rollout"):
            groups, metrics = self.generation.collect(step)
        if s.console is not None:
            s.console.show_samples(groups)
        batch = None
        if groups:
            with s.backend_use(), timed("advantages"):  # scoring (its own phase) runs on the ranks
                batch, adv_metrics = make_train_batch(
                    groups, s.start.components.objective, s.backend, step, s.hooks
                )
            metrics |= adv_metrics
        return StepBatch(batch, metrics, [g.prompt.index for g in groups])


class SupervisedStage:
    """Supervised fine-tuning: the next conversations, with loss on the assistant's tokens, or the next
    samples of a source that makes them itself (e.g. images with their conditioning)."""

    def __init__(self, stage: SFTStage) -> None:
        self.stage = stage

    def next_batch(self, step: int) -> StepBatch:
        with timed("data"):  # reading (and tokenizing) the data
            batch, metrics = self.stage.next_batch(step)
        prompts = [] if batch is None else [s.prompt.index for s in batch.samples]
        return StepBatch(batch, metrics, prompts)


class Session:
    """The services of one run (see the module docstring); a context manager."""

    def __init__(self, config: MilesConfig, start: RunStart, stop: StopRequest, pm: Any) -> None:
        self.config = config
        self.start = start
        self.run: RunDir = start.run
        self.stop = stop
        self.pm = pm
        self.hooks = Hooks(pm)
        self.rl = config.mode == "rl"
        self.status = "failed"  # what the marker says if the run ends any other way than below
        self.checkpoint = start.checkpoint
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_hard_stop)
        # Held while the engines' weights change; a shared-engine evaluation holds it while it measures.
        self.weights_lock = threading.Lock()
        self.console: Any = None
        self.fleet: EngineFleet | None = None
        self.backend: Backend
        self.stage: RLStage | SupervisedStage
        self.generation: Any = None
        self.evaluator: Any = None
        self._stack = contextlib.ExitStack()
        self._eval_stack: contextlib.ExitStack | None = None

    # ------------------------------------------------------------- open / close

    def __enter__(self) -> Session:
        try:
            self._open(self._stack)
        except BaseException:
            self._stack.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.__exit__(exc_type, exc, tb)

    def _open(self, stack: contextlib.ExitStack) -> None:
        config, start, loop = self.config, self.start, self.loop
        components = start.components
        # Last of all (engines stopped): the marker says how the run ended, start-up failures included.
        stack.callback(lambda: self.run.update_marker(status=self.status))
        stack.callback(loop.close)
        stack.callback(_cancel_pending, loop)  # a hard stop leaves tasks behind: end them quietly
        stack.enter_context(self.stop.installed())
        engines: list[Any] = []
        sessions = [
            x for c in (components, *components.adapters.values()) for x in (c.reward, *c.reward_postprocess)
        ]
        stack.callback(lambda: loop.run_until_complete(_close_clients([*engines, *sessions])))
        self.console = _start_trackers(config, self.run, start.state.step, self.pm, stack).get("console")
        stack.enter_context(placement_session(config))
        engine_urls: list[str] = []
        transport_options: dict[str, Any] = {}
        if self.rl:  # launched (or attached) and supervised: a dead or hung engine is restarted
            self.fleet = stack.enter_context(
                engine_fleet(config, start.model_path, self.run.sub("engines"), self.run.path)
            )
            engine_urls, transport_options = self.fleet.urls, self.fleet.transport_options
            engines.extend(self.fleet.clients())
        self.backend = stack.enter_context(
            trainer(config, start.model_path, components.objective, engine_urls, transport_options, self.pm)
        )
        if start.checkpoint:
            self.backend.load_checkpoint(os.path.join(start.checkpoint, "trainer"))
            if self.fleet is not None and start.state.weight_version > 0:
                self.fleet.update_weights(self.backend, start.state.weight_version)  # checked like any update
        if not self.rl:
            self.stage = SupervisedStage(_sft_stage(config, components.data_source, start.model_path))
            return
        assert self.fleet is not None
        # Sessions stick to one data-parallel rank of an engine that has several.
        dp_sizes = fleet_dp_sizes(engine_urls, self.config) if components.services else None
        ctx = _rollout_context(config, start.model_path, engines, components, self.console, dp_sizes)
        ctx.services = stack.enter_context(
            started_services(components.services, config, engine_urls, ctx.tokenizer, ctx.sampling, dp_sizes)
        )
        teacher = stack.enter_context(served_teacher(config, ctx.tokenizer, loop, self.run.sub("teachers")))
        if teacher is not None:
            ctx.scorers.append(teacher)
        self.generation = _generation(config, start, ctx, self.fleet, loop, self.hooks, self.console)
        stack.callback(self.generation.close)
        self.stage = RLStage(self, self.generation)
        if config.eval is not None:  # its own stack: closed (and drained) right after the last step
            self._eval_stack = stack.enter_context(contextlib.ExitStack())
            self.evaluator = self._eval_stack.enter_context(_evaluator(self, ctx, engine_urls))

    # ------------------------------------------------------------- step operations

    def begin(self) -> None:
        """The run is up: plugins hear so, and from here a first signal finishes the step first."""
        self.hooks.miles_on_run_start(config=self.config, run_dir=self.run.path)
        self.run.update_marker(status="running")
        self.stop.graceful = True

    def next_batch(self, step: int) -> StepBatch:
        return self.stage.next_batch(step)

    def train(self, step: int, batch: TrainBatch | None) -> dict[str, float]:
        if batch is None:
            return {"train/skipped": 1.0}
        with self.backend_use(), timed("train_step"):
            return dict(self.hooks.miles_train_step(step=step, batch=batch) or {})

    def state_after(self, step: int) -> LoopState:
        data = self.start.components.data_source.state_dict()
        return LoopState(step=step + 1, weight_version=step + 1, data_source=data)

    def save_when_due(self, step: int, state: LoopState) -> None:
        every = self.config.run.save_every
        if every is not None and ((step + 1) % every == 0 or step + 1 == self.config.run.num_steps):
            with timed("checkpoint"):
                self.save(state)

    def save(self, state: LoopState) -> None:
        staging = self.run.staging_dir(state.step)
        with self.backend_use():
            self.backend.save_checkpoint(os.path.join(staging, "trainer"))
        self.checkpoint = self.run.commit_checkpoint(
            staging, state.step, state, self.config.run.keep_checkpoints
        )
        self.hooks.miles_on_checkpoint_saved(step=state.step - 1, directory=self.checkpoint)

    def update_weights_when_due(self, step: int) -> dict[str, float]:
        """RL: the engines serve version step+1 from here when an update (or an evaluation) is due."""
        if not self.rl:
            return {}
        assert self.fleet is not None
        metrics: dict[str, float] = {}
        if self._update_due(step) or self._eval_due(step):
            version = step + 1
            with timed("weight_update"), self.weights_lock, self.generation.weights_changing(version):
                stats = self.fleet.update_weights(self.backend, version)  # every engine serves it after
            self.hooks.miles_on_weights_updated(version=version, stats=stats)
            metrics |= describe_update(stats)
        return metrics | self.fleet.metrics()

    def evaluate_when_due(self, step: int) -> None:
        """Start an evaluation when due; log the finished ones against the step they measured."""
        if self.evaluator is None:
            return
        with timed("eval"):  # a shared-engine evaluation may hold the step; a snapshot one starts
            if self._eval_due(step):
                self._engines_hold_memory()
                self.evaluator.start(step)
            self._log_evaluations(step)

    def log(self, step: int, metrics: dict[str, float], prompts: list[int]) -> None:
        self.run.record_trained_prompts(step, prompts)
        self.hooks.miles_on_metrics(step=step, metrics=metrics)
        self.run.update_marker(steps_done=step + 1)

    def finish(self, state: LoopState) -> str | None:
        """After the last step: wait for evaluations and export; after a stop: keep what is done resumable."""
        if state.step < self.config.run.num_steps:  # stopped by a signal
            if self.config.run.save_every is not None and not _is_checkpoint_of(self.checkpoint, state.step):
                self.save(state)
            self.status = "interrupted"
            return None
        if self._eval_stack is not None:  # wait for the evaluations still running, then log them
            self._engines_hold_memory()
            self._eval_stack.close()
            self._log_evaluations(self.config.run.num_steps - 1)
        final_dir = None
        if self.config.run.export_hf:
            final_dir = self.run.sub("final")
            with self.backend_use():
                self.backend.export_hf(final_dir)
        self.status = "completed"
        return final_dir

    def end(self) -> None:
        self.hooks.miles_on_run_end(run_dir=self.run.path, status=self.status)

    # ------------------------------------------------------------- helpers

    def backend_use(self) -> contextlib.AbstractContextManager[object]:
        """Held around the driver's backend calls: the fleet catches a restarted engine up from the
        trainer's weights on its own thread, and must not use the backend at the same time."""
        return self.fleet.backend_lock if self.fleet is not None else contextlib.nullcontext()

    def _engines_hold_memory(self) -> None:
        """An evaluation generates on the engines: with engine.release_memory they need their KV cache
        back (the next rollout frees it again; an evaluation still running then waits for the one after)."""
        if self.fleet is not None and self.config.engine.release_memory:
            self.fleet.resume_memory()

    def _update_due(self, step: int) -> bool:
        if self.config.schedule == "sync":
            return True  # the next rollout must sample from the weights just trained
        every = self.config.fully_async.update_every
        return (step + 1) % every == 0 or step + 1 == self.config.run.num_steps

    def _eval_due(self, step: int) -> bool:
        return self.evaluator is not None and self.evaluator.due(step)

    def _log_evaluations(self, step: int) -> None:
        for result in self.evaluator.collect(step):
            self.hooks.miles_on_eval(step=result.step, metrics=result.as_metrics())


# ------------------------------------------------------------------- builders


def _generation(
    config: MilesConfig,
    start: RunStart,
    ctx: RolloutContext,
    fleet: EngineFleet,
    loop: asyncio.AbstractEventLoop,
    hooks: Hooks,
    console: Any,
) -> Any:
    """The schedule's generation side: a synchronous stage, or a started fully asynchronous worker."""
    r = config.rollout
    components = start.components
    if components.adapters:  # multi-LoRA: a rollout per adapter, one mixed batch
        from miles.driver.adapters import adapter_generation

        return adapter_generation(config, components, ctx, fleet.clients, loop, hooks, console)
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
    first_step = start.state.step
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


def _evaluator(session: Session, ctx: RolloutContext, engine_urls: list[str]) -> Any:
    from miles.eval import Evaluator

    worker = getattr(session.generation, "worker", None)
    pause = getattr(worker, "pause_production", contextlib.nullcontext)
    return Evaluator(
        session.config,
        model_path=session.start.model_path,
        tokenizer=ctx.tokenizer,
        services=ctx.services,
        run_dir=session.run.path,
        engine_urls=engine_urls,
        export_snapshot=lambda directory: _locked_export(session, directory),
        pause_production=pause,
        weights_lock=session.weights_lock,
    )


def _locked_export(session: Session, directory: str) -> None:
    """The evaluator's snapshot export runs on its own thread: it takes its turn on the backend."""
    with session.backend_use():
        session.backend.export_hf(directory)


def _rollout_context(
    config: MilesConfig,
    model_path: str,
    engines: list[Any],
    components: Any,
    console: Any,
    dp_sizes: list[int] | None,
) -> RolloutContext:
    r = config.rollout
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )
    # An engine kind whose engines take no token ids has no use for the policy's tokenizer (and its
    # model directory may hold none).
    tokens = engine_capabilities(load_component("engine", config.engine.launcher)).tokens
    return RolloutContext(
        engines=engines,
        tokenizer=_tokenizer(model_path) if tokens else None,
        sampling=sampling,
        n_samples_per_prompt=r.n_samples_per_prompt,
        reward=components.reward,
        reward_postprocess=list(components.reward_postprocess),
        options=dict(r.options),
        on_sample_done=console.sample_done if console is not None else None,
        dp_sizes=dp_sizes,
        return_routed_experts=records_routing(config),
    )


def _start_trackers(
    config: MilesConfig, run: RunDir, first_step: int, pm: Any, stack: contextlib.ExitStack
) -> dict[str, Any]:
    # The recipe's trackers (and the rollout dumper), each registered as a guarded hook plugin.
    return start_trackers(config, run, first_step, pm, stack)


def _sft_stage(config: MilesConfig, data_source: Any, model_path: str) -> SFTStage:
    """Chat conversations (tokenized here), or a source that makes its samples itself (no tokenizer)."""
    batch_size = config.sft.batch_size
    source = getattr(data_source, "inner", data_source)  # SharedDataSource: the source it wraps
    if isinstance(source, SupervisedSampleSource):
        return SFTStage(data_source, source.supervised_sample, batch_size=batch_size, tokens=False)
    return SFTStage.conversations(
        data_source, _tokenizer(model_path), batch_size=batch_size, max_length=config.sft.max_length
    )


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _is_checkpoint_of(checkpoint: str | None, step: int) -> bool:
    return checkpoint is not None and RunDir.read_state(checkpoint).step == step


def _quiet_hard_stop(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a task a hard stop (the second SIGINT/SIGTERM) interrupted
    keeps that interrupt as its exception, and asyncio would print it as "never retrieved" when
    the task is collected, after the stop was already reported in one line. Everything else goes
    to asyncio's default handler."""
    if isinstance(context.get("exception"), SignalInterrupt):
        return
    loop.default_exception_handler(context)


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


async def _close_clients(objects: list[Any]) -> None:
    """Close what holds network sessions: engine clients, remote rewards (anything with ``aclose``)."""
    for obj in objects:
        close = getattr(obj, "aclose", None)
        if close is not None:
            await close()
