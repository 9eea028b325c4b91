"""The diffusion rollout (``rollout.fn: diffusion``) and its prompt source (``data.source: diffusion_prompts``).

Per prompt, one request to a diffusion engine for the whole group: ``n_samples_per_prompt``
trajectories of the prompt id, each from its own seed. Each trajectory becomes a core ``Sample``
whose token fields stay empty and whose ``payload`` is a :class:`~miles_diffusion.payload.TrajectoryPayload`;
then the run's reward scores the group (the image rewards of ``miles_diffusion.group_rewards`` are
group rewards: one batched call), the reward post-processors run, and the core's buffer, advantage
stage and backend take it from there.

**Pipelined** (``rollout.options.pipeline: true``): the engine samples the group in microgroups of
``microgroup_size`` (its prompt encoded once for all of them) and streams each back as soon as it
is drawn; a decode worker process unpacks it and the reward scores it at once, while the engine
samples the next. A reward that scores each image on its own (``scores_independently``, as the
image rewards do) is called per microgroup; any other group reward once the group's last
microgroup is in. The group is complete, and reaches the buffer and the advantage stage, after its
last microgroup is scored. Pipelining changes no number: the same ``microgroup_size`` with
``pipeline: false`` gives the same trajectories, log-probabilities and rewards bit for bit.

Seeds are derived from ``(rollout.options.seed, step, prompt index, attempt, sample)``, so a run
repeats exactly and a resumed run draws what the uninterrupted one would have drawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import re
import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from miles.builtins.data.records import PromptPool
from miles.capabilities import ComponentOptions, NoOptions
from miles.engines.client import EngineUnavailable
from miles.errors import DataError
from miles.interfaces import RolloutContext
from miles.tracking.timing import add_busy
from miles.types import Group, Prompt, Sample, Status
from miles_diffusion.decode import decode_pool
from miles_diffusion.payload import split
from miles_diffusion.sampler import SamplerConfig
from miles_diffusion.wire import TrajectoryBatch


class DiffusionRolloutOptions(ComponentOptions):
    """``rollout.options`` of the diffusion rollout: how the engines sample."""

    num_steps: int = Field(8, ge=1, le=1000, description="denoising (SDE) steps per trajectory")
    noise_level: float = Field(
        0.7, gt=0.0, description="the SDE's noise scale (sigma_t = a sqrt(t / (1 - t)))"
    )
    seed: int = Field(0, ge=0, description="base of every trajectory's noise seed")
    guidance_scale: float = Field(
        1.0,
        ge=1.0,
        allow_inf_nan=False,
        description="classifier-free guidance scale w (1: none): each step's velocity is v_uncond + "
        "w (v_cond - v_uncond), both branches in one forward pass of twice the batch (sd3, wan); the "
        "trainer re-scores with the same w",
    )
    microgroup_size: int | None = Field(
        None,
        ge=1,
        description="trajectories the engine samples together; a group is sampled in microgroups of this "
        "size, its prompt encoded once (default: the whole group at once)",
    )
    pipeline: bool = Field(
        False,
        description="stream each microgroup back as soon as it is sampled, unpack it in a decode worker "
        "process and score it while the engine samples the next",
    )
    decode_workers: int = Field(
        2, ge=1, le=64, description="decode worker processes of the pipelined rollout (one pool per process)"
    )
    prompts: list[str] | None = Field(
        None,
        min_length=1,
        description="the prompt texts of a text-prompted model family (sd3): prompt id i is prompts[i]; "
        "the rollout sends each trajectory's text to the engine, the backend encodes the same texts",
    )

    @property
    def sampler(self) -> SamplerConfig:
        return SamplerConfig(
            num_steps=self.num_steps,
            noise_level=float(self.noise_level),
            guidance_scale=float(self.guidance_scale),
        )


def trajectory_seed(base: int, step: int, prompt_index: int, attempt: int, sample: int) -> int:
    """A 63-bit seed, well mixed, from what identifies one trajectory of a run."""
    key = f"{base}:{step}:{prompt_index}:{attempt}:{sample}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def prompt_id(prompt: Prompt) -> int:
    """The integer id a class-conditioned model is prompted with (the prompt's text is the id)."""
    text = prompt.prompt
    if isinstance(text, str) and text.strip().isdigit():
        return int(text.strip())
    raise DataError(
        f"prompt {prompt.index}: {str(text)[:60]!r} is not a prompt id; the tiny diffusion models are "
        "conditioned on integer ids (data.source: diffusion_prompts, path: ids:N)"
    )


class DiffusionRollout:
    """``rollout.fn: diffusion``: one engine request per group, then the group's reward."""

    Options = DiffusionRolloutOptions

    def __init__(self, generate_fn: str = "default") -> None:
        # The core hands every rollout class the recipe's generate_fn; this rollout has no token
        # generate layer (the recipe check refuses a generate_fn set for it).
        self._attempts: dict[tuple[int, int], int] = {}

    async def __call__(self, ctx: RolloutContext, prompts: list[Prompt]) -> list[Group]:
        options = DiffusionRolloutOptions(**ctx.options)
        groups: list[Group] = []
        jobs = []
        for prompt in prompts:
            pid = prompt_id(prompt)
            key = (ctx.step, prompt.index)
            attempt = self._attempts.get(key, 0)  # a prompt refilled within one step gets fresh seeds
            self._attempts[key] = attempt + 1
            n = ctx.n_samples_per_prompt
            seeds = [trajectory_seed(options.seed, ctx.step, prompt.index, attempt, i) for i in range(n)]
            group = Group(prompt=prompt, samples=[Sample(prompt=prompt, group_index=i) for i in range(n)])
            groups.append(group)
            jobs.append(self._run_group(ctx, group, pid, seeds, options))
        self._attempts = {k: v for k, v in self._attempts.items() if k[0] >= ctx.step}
        await asyncio.gather(*jobs)
        return groups

    async def _run_group(
        self, ctx: RolloutContext, group: Group, pid: int, seeds: list[int], options: DiffusionRolloutOptions
    ) -> None:
        served_at_start = ctx.served_version
        texts = None
        if options.prompts is not None:
            if not 0 <= pid < len(options.prompts):
                raise DataError(
                    f"prompt id {pid} has no text: rollout.options.prompts holds {len(options.prompts)} "
                    f"(ids 0..{len(options.prompts) - 1})"
                )
            texts = [options.prompts[pid]] * len(seeds)
        # Per microgroup only when the reward scores each image alone: a group-relative reward needs them all.
        per_microgroup = options.pipeline and bool(getattr(ctx.reward, "scores_independently", False))
        try:
            async with ctx.router.request(None, sticky=False) as route:
                engine = route.engine
                if options.pipeline:
                    stream = getattr(engine, "stream_microgroups", None)
                    if stream is None:
                        raise TypeError(_not_diffusion(engine))
                    microgroups = stream(
                        [pid] * len(seeds),
                        seeds,
                        options.sampler,
                        options.microgroup_size,
                        decode_pool(options.decode_workers),
                        **({} if texts is None else {"texts": texts}),
                    )
                    async with contextlib.aclosing(microgroups):
                        async for microgroup in microgroups:
                            samples = group.samples[
                                microgroup.offset : microgroup.offset + len(microgroup.batch.seeds)
                            ]
                            _attach(samples, microgroup.batch, served_at_start, pid)
                            if per_microgroup:
                                await _reward(ctx, samples)
                else:
                    generate = getattr(engine, "generate_trajectories", None)
                    if generate is None:
                        raise TypeError(_not_diffusion(engine))
                    batch = await generate(
                        [pid] * len(seeds),
                        seeds,
                        options.sampler,
                        microgroup_size=options.microgroup_size,
                        **({} if texts is None else {"texts": texts}),
                    )
                    _attach(group.samples, batch, served_at_start, pid)
        except EngineUnavailable as exc:  # not the group's fault: aborted, so the buffer retries it
            for sample in group.samples:
                sample.status = Status.ABORTED
                sample.finish_reason = "abort"
                sample.reward = None
                sample.payload = None
                sample.metadata["engine_error"] = str(exc)
            return
        if not per_microgroup:
            await _reward(ctx, group.samples)
        for sample in group.samples:
            if sample.reward is not None and sample.status is Status.COMPLETED:
                try:
                    for post in ctx.reward_postprocess:
                        sample.reward = float(post(sample, sample.reward))
                except Exception as exc:
                    _fail([sample], "reward_postprocess_error", exc)
            if ctx.on_sample_done is not None:
                ctx.on_sample_done(sample)


def _not_diffusion(engine: Any) -> str:
    return f"engine {engine.url} cannot generate trajectories; the diffusion rollout needs engine.launcher: diffusion"


def _attach(samples: list[Sample], batch: TrajectoryBatch, served_at_start: int | None, pid: int) -> None:
    """Give ``samples`` the batch's trajectories, in order, as finished samples."""
    version = batch.weight_version if served_at_start is None else min(batch.weight_version, served_at_start)
    for sample, payload in zip(
        samples, split(batch.trajectory, batch.seeds, batch.sampler, version, batch.images), strict=True
    ):
        sample.payload = payload
        sample.status = Status.COMPLETED
        sample.finish_reason = "stop"
        shape = "x".join(str(n) for n in payload.latents.shape[1:])  # [C, H, W] or a video's [C, F, h, w]
        sample.response_text = f"<image {shape}, prompt id {pid}, seed {payload.seed}>"
        sample.metadata.update(seed=payload.seed, weight_version=version)


async def _reward(ctx: RolloutContext, samples: list[Sample]) -> None:
    """The run's reward on the group: a group reward in one call, a per-sample reward per sample.
    A reward that raises marks its samples FAILED with reward 0 (the run goes on)."""
    t0 = time.perf_counter()
    try:
        if getattr(ctx.reward, "group_reward", False):
            produced: Any = ctx.reward(samples)  # type: ignore[arg-type]
            if inspect.isawaitable(produced):
                produced = await produced
            values = [float(v) for v in produced]
            if len(values) != len(samples):
                raise ValueError(f"group reward returned {len(values)} rewards for {len(samples)} samples")
        else:
            values = []
            for sample in samples:
                value = ctx.reward(sample)
                values.append(float(await value if inspect.isawaitable(value) else value))
    except Exception as exc:
        _fail(samples, "reward_error", exc)
        return
    finally:
        add_busy("rollout/reward", time.perf_counter() - t0)
    for sample, value in zip(samples, values, strict=True):
        sample.reward = value


def _fail(samples: Sequence[Sample], key: str, exc: Exception) -> None:
    for sample in samples:
        sample.status = Status.FAILED
        sample.reward = 0.0
        sample.metadata[key] = f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- prompts

_IDS = re.compile(r"^ids:([1-9][0-9]*)$")


class PromptIdSource(PromptPool):
    """``data.source: diffusion_prompts``: the prompt ids ``0 .. N-1`` of a class-conditioned model
    (``data.path: ids:N``), in the core's deterministic, resumable order (``data.shuffle``, ``data.seed``).

    The text fields of the data section (prompt_key, templates, chat template) have nothing to format here.
    """

    Options = NoOptions  # data.options

    def __init__(self, path: str, shuffle: bool = True, seed: int = 0, **_text_fields: Any) -> None:
        match = _IDS.match(str(path).strip())
        if match is None:
            raise DataError(
                f"data.path {path!r}: the diffusion_prompts source takes ids:N (prompt ids 0..N-1, e.g. ids:4)"
            )
        n = int(match.group(1))
        prompts = [Prompt(index=i, prompt=str(i), label=None) for i in range(n)]
        super().__init__(prompts, shuffle=shuffle, seed=seed, name=f"prompt ids {path!r}")
