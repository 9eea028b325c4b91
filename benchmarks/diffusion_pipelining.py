"""Step time of the diffusion rollout (generate + unpack + reward) with and without pipelining, CPU.

    uv run python benchmarks/diffusion_pipelining.py [--steps 6] [--only tiny,large_jpeg,large_scorer]

A diffusion engine process (``python -m miles_diffusion.engine``, torch on one thread, as the
recipes start it) serves a model with random weights; this process runs the package's
``DiffusionRollout`` against it, as ``miles run`` does, one rollout call per step. Three modes,
interleaved step by step (so a change of load on the shared machine hits all three alike):

- ``whole``: today's default, one request per group, sampled as one batch, answered in one buffer,
  unpacked on a thread, scored once the group is in;
- ``microgrouped``: the same with ``microgroup_size`` (the engine samples microgroups in turn, one
  buffer at the end): what the smaller batches cost by themselves;
- ``pipelined``: ``microgroup_size`` and ``pipeline: true``: each microgroup streamed as soon as it
  is sampled, unpacked in a decode worker process, scored while the engine samples the next.

Besides the step time, the *tail*: the seconds from the moment the step's last trajectories reached
the rollout (unpacked) to the step's end, the client work that nothing overlaps. Pipelining shrinks
the tail from a whole group's reward to one microgroup's; the engine's sampling, the bulk of a CPU
step, it cannot shorten, and on this shared 2-core machine that sampling's time varies with the
other tenants' load by more than the tail.

Configurations: ``tiny`` (the ``tiny_flow_grpo`` recipe's shape: 16x16, 8 steps, 4 prompts x 4,
brightness; microgroups of 2), ``large_jpeg`` (64x64 images, a slimmer UNet, 16 steps, 2 prompts
x 8, microgroups of 4, the JPEG compressibility reward) and ``large_scorer`` (the same with a learned-reward stand-in: a
random-weight convnet scoring each image, at about the cost of one or two denoising steps per image,
as a reward model's forward pass is beside a generator's many steps), and ``one_group_scorer`` (the
same, one prompt x 16 per step: a step that is one large group, where the unpipelined tail is the
whole step's reward). The step time is the
rollout call's wall time, median over ``--steps`` steps after one warm-up step per mode.

Also timed: unpacking one large configuration group's trajectories from its bytes, three ways
(base64 text in JSON, the one-buffer safetensors unpack, and the pipelined frame reader + decode
worker), median of 7.

Results go to ``benchmarks/results/diffusion_pipelining.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench import RESULTS_DIR, load_avg, machine_info, write_result
from torch import nn

from miles.interfaces import EngineSpec, RolloutContext
from miles.types import Prompt, Sample, SamplingParams
from miles_diffusion.decode import close_decode_pools, decode_pool
from miles_diffusion.engine.client import DiffusionClient
from miles_diffusion.engine.launcher import DiffusionLauncher
from miles_diffusion.group_rewards import BrightnessReward, ImageGroupReward, JpegCompressibilityReward
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, save_pretrained
from miles_diffusion.rollout import DiffusionRollout
from miles_diffusion.sampler import SamplerConfig, sample_seeded
from miles_diffusion.wire import FrameReader, TrajectoryBatch, frame_prefix, pack, pack_microgroup, unpack

MODES = ("whole", "microgrouped", "pipelined")


class ConvScorer:
    """A learned-reward stand-in: a random-weight convnet mapping each image to one score."""

    def __init__(self, width: int = 48, depth: int = 6, seed: int = 0) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.GELU()]
            for _ in range(depth):
                layers += [nn.Conv2d(width, width, 3, padding=1), nn.GELU()]
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1)]
            self.net = nn.Sequential(*layers).eval()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        return self.net(images.float()).squeeze(1)


class TimedClient(DiffusionClient):
    """Notes when the last trajectories of a step reached the rollout (unpacked): the step's tail
    after that is client work nothing overlaps any more."""

    last_arrival = 0.0

    async def generate_trajectories(self, *args: Any, **kwargs: Any) -> Any:
        batch = await super().generate_trajectories(*args, **kwargs)
        self.last_arrival = max(self.last_arrival, time.perf_counter())
        return batch

    async def stream_microgroups(self, *args: Any, **kwargs: Any) -> Any:
        async for microgroup in super().stream_microgroups(*args, **kwargs):
            self.last_arrival = max(self.last_arrival, time.perf_counter())
            yield microgroup


class TimedReward:
    """Wraps a group reward and sums the seconds spent in it."""

    group_reward = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.scores_independently = bool(getattr(inner, "scores_independently", False))
        self.seconds = 0.0

    def __call__(self, samples: list[Sample]) -> list[float]:
        started = time.perf_counter()
        try:
            return list(self.inner(samples))
        finally:
            self.seconds += time.perf_counter() - started


@dataclass(frozen=True)
class Config:
    name: str
    model: TinyFlowModelConfig
    num_steps: int
    prompts: int
    group: int
    microgroup: int
    reward: str

    def make_reward(self) -> Any:
        if self.reward == "brightness":
            return BrightnessReward()
        if self.reward == "jpeg_compressibility":
            return JpegCompressibilityReward()
        return ImageGroupReward(ConvScorer(), "conv_scorer")


_LARGE = TinyFlowModelConfig(image_size=64, block_out_channels=(8, 16))
CONFIGS = {
    "tiny": Config("tiny", TinyFlowModelConfig(), 8, 4, 4, 2, "brightness"),
    "large_jpeg": Config("large_jpeg", _LARGE, 16, 2, 8, 4, "jpeg_compressibility"),
    "large_scorer": Config("large_scorer", _LARGE, 16, 2, 8, 4, "conv_scorer"),
    "one_group_scorer": Config("one_group_scorer", _LARGE, 16, 1, 16, 4, "conv_scorer"),
}


def _options(config: Config, mode: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_steps": config.num_steps,
        "noise_level": 0.7,
        "seed": 0,
        "decode_workers": 2,
        **(extra or {}),
    }
    if mode != "whole":
        options["microgroup_size"] = config.microgroup
    if mode == "pipelined":
        options["pipeline"] = True
    return options


async def _bench_config(
    config: Config,
    url: str,
    steps: int,
    *,
    num_prompts: int | None = None,
    extra_options: dict[str, Any] | None = None,
    reward_fn: Any = None,
) -> dict[str, Any]:
    """``num_prompts``: prompt ids drawn (default: the tiny model's); ``extra_options``: more rollout
    options (a text model's ``prompts``); ``reward_fn``: the reward (default: the config's)."""
    client = TimedClient(url)
    # One rollout per mode: a rollout called twice in a step draws fresh seeds (a refill), and the
    # modes must draw the same trajectories at each step.
    rollouts = {mode: DiffusionRollout() for mode in MODES}
    reward = TimedReward(reward_fn if reward_fn is not None else config.make_reward())
    times: dict[str, list[float]] = {m: [] for m in MODES}
    reward_s: dict[str, list[float]] = {m: [] for m in MODES}
    tail_s: dict[str, list[float]] = {m: [] for m in MODES}
    rewards: dict[str, list[float]] = {m: [] for m in MODES}
    ids = num_prompts or config.model.num_prompts
    prompts = [Prompt(index=i, prompt=str(i % ids)) for i in range(config.prompts)]
    try:
        for step in range(steps + 1):  # step 0 warms every mode up (decode workers start, caches fill)
            order = MODES[step % 3 :] + MODES[: step % 3]
            for mode in order:
                ctx = RolloutContext(
                    engines=[client],
                    tokenizer=None,
                    sampling=SamplingParams(),
                    n_samples_per_prompt=config.group,
                    reward=reward,
                    options=_options(config, mode, extra_options),
                    step=step,
                )
                reward.seconds = 0.0
                client.last_arrival = 0.0
                started = time.perf_counter()
                groups = await rollouts[mode](ctx, prompts)
                ended = time.perf_counter()
                elapsed = ended - started
                if any(s.reward is None for g in groups for s in g.samples):
                    raise RuntimeError(f"{config.name} {mode}: a sample was not scored")
                if step > 0:
                    times[mode].append(elapsed)
                    reward_s[mode].append(reward.seconds)
                    tail_s[mode].append(ended - client.last_arrival)
                    rewards[mode].append(statistics.fmean(s.reward for g in groups for s in g.samples))
    finally:
        await client.aclose()
    out: dict[str, Any] = {"config": _describe(config), "modes": {}}
    for mode in MODES:
        out["modes"][mode] = {
            "step_s": times[mode],
            "median_step_s": statistics.median(times[mode]),
            "median_reward_busy_s": statistics.median(reward_s[mode]),
            "median_tail_s": statistics.median(tail_s[mode]),
            "mean_reward": statistics.fmean(rewards[mode]),
        }
    whole = out["modes"]["whole"]["median_step_s"]
    piped = out["modes"]["pipelined"]["median_step_s"]
    out["pipelined_vs_whole"] = piped / whole
    out["pipelined_vs_microgrouped"] = piped / out["modes"]["microgrouped"]["median_step_s"]
    return out


def _describe(config: Config) -> dict[str, Any]:
    m = config.model
    return {
        "image": f"{m.channels}x{m.image_size}x{m.image_size}",
        "unet_channels": list(m.block_out_channels),
        "denoising_steps": config.num_steps,
        "prompts_x_group": f"{config.prompts} x {config.group}",
        "microgroup_size": config.microgroup,
        "reward": config.reward,
    }


def _sampling_and_reward_cost(config: Config) -> dict[str, float]:
    """One group sampled in this process, and its reward: what the client's work weighs beside the engine's."""
    model = build_tiny_model(config.model, seed=0).eval()
    sampler = SamplerConfig(config.num_steps, 0.7)
    prompts = torch.zeros(config.microgroup, dtype=torch.int64)
    sample_seeded(model, prompts, list(range(config.microgroup)), sampler)  # warm-up
    started = time.perf_counter()
    trajectory = sample_seeded(model, prompts, list(range(config.microgroup)), sampler)
    sample_s = time.perf_counter() - started
    reward = config.make_reward()
    from miles_diffusion.payload import split

    samples = [
        Sample(prompt=Prompt(index=0, prompt="0"), group_index=i, payload=p)
        for i, p in enumerate(split(trajectory, list(range(config.microgroup)), sampler, 0))
    ]
    reward(samples)
    started = time.perf_counter()
    reward(samples)
    reward_s = time.perf_counter() - started
    return {"microgroup_sample_s": sample_s, "microgroup_reward_s": reward_s}


def _median_ms(fn: Any, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def _unpack_costs(config: Config) -> dict[str, Any]:
    """One group's trajectories, from bytes to tensors, three ways (random tensors of the real shapes)."""
    m = config.model
    n, s = config.group, config.num_steps
    trajectory_shape = (n, s + 1, m.channels, m.image_size, m.image_size)
    from miles_diffusion.sampler import Trajectory, timestep_schedule

    trajectory = Trajectory(
        latents=torch.randn(trajectory_shape),
        timesteps=timestep_schedule(s),
        log_probs=torch.randn(n, s),
        prompts=torch.zeros(n, dtype=torch.int64),
    )
    sampler = SamplerConfig(s, 0.7)
    batch = TrajectoryBatch(trajectory, list(range(n)), sampler, 0)
    data = pack(batch)
    as_json = json.dumps(
        {
            name: {
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "b64": base64.b64encode(t.numpy().tobytes()).decode(),
            }
            for name, t in (("latents", trajectory.latents), ("log_probs", trajectory.log_probs))
        }
    )

    def from_json() -> None:
        doc = json.loads(as_json)
        for entry in doc.values():
            raw = bytearray(base64.b64decode(entry["b64"]))
            torch.frombuffer(raw, dtype=torch.float32).view(entry["shape"])

    microgroups = []
    for k, offset in enumerate(range(0, n, config.microgroup)):
        rows = slice(offset, offset + config.microgroup)
        part = TrajectoryBatch(
            type(trajectory)(
                trajectory.latents[rows],
                trajectory.timesteps,
                trajectory.log_probs[rows],
                trajectory.prompts[rows],
            ),
            list(range(n))[rows],
            sampler,
            0,
        )
        microgroups.append(
            pack_microgroup(
                part, index=k, count=-(-n // config.microgroup), offset=offset, started_ns=0, finished_ns=0
            )
        )
    stream = b"".join(frame_prefix(b) + b for b in microgroups)
    pool = decode_pool(2)
    pool.start()

    async def pipelined() -> float:
        """Median ms from the stream's bytes (cut in 64 KiB chunks, as a socket delivers them) to
        every microgroup unpacked, timed inside one event loop (as the rollout runs)."""

        async def once() -> None:
            reader = FrameReader(shared=True)
            jobs = []
            for i in range(0, len(stream), 65536):
                jobs += [pool.decode(f) for f in reader.feed(stream[i : i + 65536])]
            await asyncio.gather(*jobs)

        await once()
        times = []
        for _ in range(7):
            started = time.perf_counter()
            await once()
            times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    return {
        "group_bytes": len(data),
        "base64_json_ms": _median_ms(from_json),
        "safetensors_one_buffer_ms": _median_ms(lambda: unpack(data)),
        "frames_via_decode_workers_ms": asyncio.run(pipelined()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--only", default=",".join(CONFIGS), help="configurations to run, comma-separated")
    parser.add_argument("--out", default=str(RESULTS_DIR / "diffusion_pipelining.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"machine": machine_info(), "steps": args.steps, "configs": {}}
    try:
        for name in args.only.split(","):
            config = CONFIGS[name]
            with tempfile.TemporaryDirectory() as root:
                model_dir = save_pretrained(build_tiny_model(config.model, seed=0), Path(root) / "model")
                launcher = DiffusionLauncher()
                options = {"torch_threads": 1, "max_batch_size": 64}
                try:
                    [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=options)], root)
                    entry = asyncio.run(_bench_config(config, url, args.steps))
                finally:
                    launcher.shutdown()
            entry["client_costs"] = _sampling_and_reward_cost(config)
            if name in ("large_jpeg", "large_scorer"):
                entry["unpack"] = _unpack_costs(config)
            result["configs"][name] = entry
            modes = entry["modes"]
            print(
                f"{name}: step whole {modes['whole']['median_step_s']:.3f} s, microgrouped "
                f"{modes['microgrouped']['median_step_s']:.3f} s, pipelined {modes['pipelined']['median_step_s']:.3f} s "
                f"(x{entry['pipelined_vs_whole']:.3f} of whole); tail whole {modes['whole']['median_tail_s']:.3f} s, "
                f"pipelined {modes['pipelined']['median_tail_s']:.3f} s; reward busy {modes['whole']['median_reward_busy_s']:.3f} s",
                flush=True,
            )
    finally:
        close_decode_pools()
    result["load_avg_at_end"] = load_avg()
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
