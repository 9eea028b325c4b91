"""Recording and replaying MoE routing (R3): what the recipe turns on, and what is refused before start.

Each refusal is one ``ConfigError`` naming the setting and the component that cannot do it: a dense
model, an engine kind that returns no routing, a rollout that does not record it, a backend that
cannot replay; and an SFT recipe (no rollouts).
"""

from __future__ import annotations

import pytest

from miles.capabilities import EngineCapabilities, declare_records_routing, declares_records_routing
from miles.errors import ConfigError
from miles.types import Sample, SamplingParams


class NoReplayBackend:
    """A backend class that says nothing about routing replay."""


class DenseOnlyBackend:
    """A backend that replays nothing for this test's model (its own refusal reaches the user)."""

    @staticmethod
    def routing_replay_problem(model_path: str, config: object) -> str | None:
        return "replays only models it was built for"


class SilentEngine:
    """An engine kind whose engines return no routing."""

    capabilities = EngineCapabilities()

    def launch(self, specs, log_dir):  # pragma: no cover - never launched
        raise AssertionError

    def client(self, url):  # pragma: no cover
        raise AssertionError

    def shutdown(self) -> None:  # pragma: no cover
        pass


async def plain_generate(ctx, sample: Sample) -> Sample:  # pragma: no cover - only loaded
    return sample


@declare_records_routing
async def recording_generate(ctx, sample: Sample) -> Sample:  # pragma: no cover - only loaded
    return sample


async def whole_rollout(ctx, prompts):  # pragma: no cover - only loaded
    return []


class WholeRollout:
    """A rollout class that is the whole rollout (ignores its generate layer) and records routing."""

    records_routing = True

    def __init__(self, generate_fn: str = "default") -> None:
        del generate_fn

    async def __call__(self, ctx, prompts):  # pragma: no cover - only loaded
        return []


HERE = "driver.test_routing_replay_checks"


@pytest.fixture(scope="module")
def models() -> dict[str, str]:
    from miles.models.registry import resolve_model

    return {"moe": resolve_model("builtin:tiny-qwen3-moe"), "dense": resolve_model("builtin:tiny-qwen3")}


def _config(model: str, *overrides: str):
    from miles.config import load_recipe

    return load_recipe("default", [f"model.path={model}", "warm_start=null", "eval=null", *overrides])


def _check(config, model: str) -> None:
    from miles.driver.routing_replay import check_routing_replay

    check_routing_replay(config, model)


def test_replay_records_routing_and_passes_with_the_built_in_components(models) -> None:
    from miles.routing import records_routing

    plain = _config(models["moe"])
    assert not records_routing(plain)
    replay = _config(models["moe"], "train.use_rollout_routing_replay=true")
    assert records_routing(replay) and not replay.rollout.record_routed_experts
    _check(replay, models["moe"])
    record_only = _config(models["moe"], "rollout.record_routed_experts=true")
    assert records_routing(record_only)
    _check(record_only, models["moe"])
    # The built-in generate function records routing; the engine kinds say how they return it.
    from miles.builtins.rollout.generate import single_turn_generate
    from miles.engines.launchers import EmbeddedLauncher, SGLangLauncher

    assert declares_records_routing(single_turn_generate)
    assert EmbeddedLauncher.capabilities.routing_capture == ()
    assert dict(SGLangLauncher.capabilities.routing_capture or ()) == {"enable_return_routed_experts": True}


@pytest.mark.parametrize(
    ("model", "overrides", "message"),
    [
        (
            "dense",
            ["train.use_rollout_routing_replay=true"],
            r"use_rollout_routing_replay: model .* is dense",
        ),
        ("dense", ["rollout.record_routed_experts=true"], r"record_routed_experts: model .* is dense"),
        (
            "moe",
            ["train.use_rollout_routing_replay=true", f"engine.launcher={HERE}:SilentEngine"],
            "does not return MoE routing",
        ),
        (
            "moe",
            ["train.use_rollout_routing_replay=true", f"rollout.generate_fn={HERE}:plain_generate"],
            r"rollout\.generate_fn .*plain_generate.* does not record MoE routing",
        ),
        (
            "moe",
            ["train.use_rollout_routing_replay=true", f"rollout.fn={HERE}:whole_rollout"],
            r"rollout\.fn .*whole_rollout.* does not record MoE routing",
        ),
        (
            "moe",
            ["train.use_rollout_routing_replay=true", f"backend={HERE}:NoReplayBackend"],
            "cannot replay routing",
        ),
        (
            "moe",
            ["train.use_rollout_routing_replay=true", f"backend={HERE}:DenseOnlyBackend"],
            "replays only models it was built for",
        ),
    ],
)
def test_what_cannot_record_or_replay_is_refused_in_one_line(models, model, overrides, message) -> None:
    config = _config(models[model], *overrides)
    with pytest.raises(ConfigError, match=message):
        _check(config, models[model])


def test_recording_alone_needs_no_replaying_backend(models) -> None:
    config = _config(models["moe"], "rollout.record_routed_experts=true", f"backend={HERE}:NoReplayBackend")
    _check(config, models["moe"])  # the samples carry routing; nothing replays it
    ok = _config(
        models["moe"],
        "train.use_rollout_routing_replay=true",
        f"rollout.generate_fn={HERE}:recording_generate",
    )
    _check(ok, models["moe"])
    # A rollout class that says it records is taken at its word, whatever generate function is named.
    whole = _config(
        models["moe"],
        "train.use_rollout_routing_replay=true",
        f"rollout.fn={HERE}:WholeRollout",
        f"rollout.generate_fn={HERE}:plain_generate",
    )
    _check(whole, models["moe"])


def test_the_fsdp_backend_declares_what_it_replays(models) -> None:
    from miles_fsdp.backend import FSDPBackend

    config = _config(models["moe"], "train.use_rollout_routing_replay=true")
    assert FSDPBackend.routing_replay_problem(models["moe"], config) is None
    assert "is dense" in (FSDPBackend.routing_replay_problem(models["dense"], config) or "")
    compiled = _config(models["moe"], "train.use_rollout_routing_replay=true", "fsdp.compile=true")
    with pytest.raises(ConfigError, match=r"backend 'fsdp': fsdp\.compile compiles"):
        _check(compiled, models["moe"])


def test_an_sft_recipe_refuses_it() -> None:
    from miles.config import load_recipe

    with pytest.raises(ConfigError, match="mode 'sft' has no rollouts"):
        load_recipe("sft-arith", ["train.use_rollout_routing_replay=true"])


def test_the_rollout_context_asks_the_engines_and_keeps_prompt_and_response_routing() -> None:
    """The built-in generate function, against a fake engine that answers like SGLang: the request
    asks for routing, and the sample gets every prompt position but the last plus the response."""
    import asyncio

    from miles.builtins.rollout.generate import single_turn_generate
    from miles.engines.client import parse_generate_response
    from miles.interfaces import RolloutContext
    from miles.types import Prompt

    prompt, output = [5, 6, 7], [8, 9]
    rows = [[[p, p + 1]] for p in range(len(prompt) + len(output) - 1)]  # one layer, top-2

    class Engine:
        url = "fake"

        def __init__(self) -> None:
            self.asked: list[bool] = []

        async def generate(self, input_ids, params, *, return_routed_experts=False, **_):
            self.asked.append(return_routed_experts)
            meta = {
                "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.5, t, None] for t in output],
                "weight_version": "0",
                "routed_experts": rows if return_routed_experts else None,
            }
            return parse_generate_response(
                {"output_ids": output, "meta_info": meta}, prompt_len=len(input_ids)
            )

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    engine = Engine()
    ctx = RolloutContext(
        engines=[engine],
        tokenizer=Tok(),
        sampling=SamplingParams(),
        n_samples_per_prompt=1,
        reward=lambda s: 0.0,
        return_routed_experts=True,
    )
    sample = asyncio.run(single_turn_generate(ctx, Sample(prompt=Prompt(0, "x"), prompt_ids=prompt)))
    assert engine.asked == [True]
    assert sample.prompt_routed_experts == rows[:2] and sample.routed_experts == rows[2:]
    sample.check_aligned()
    from miles.routing import replay_problem, sequence_routing

    assert sequence_routing(sample) == rows and replay_problem(sample) is None
