"""The built-in generate function: one engine call per trajectory (single turn)."""

from __future__ import annotations

from miles.capabilities import NoOptions, declare_options, declare_records_routing
from miles.errors import EngineError
from miles.interfaces import RolloutContext
from miles.types import Sample, Status

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@declare_records_routing  # with ctx.return_routed_experts: the prompt's and the response's routing
@declare_options(NoOptions)  # reads no rollout.options
async def single_turn_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """Sample a response to ``sample.prompt_ids`` and record exactly what the engine returned."""
    served_at_start = ctx.served_version
    async with ctx.router.request(None, sticky=False) as route:  # single turn: the least busy engine
        kwargs = {"return_routed_experts": True} if ctx.return_routed_experts else {}
        out = await route.generate(sample.prompt_ids, ctx.sampling, **kwargs)
        missing = out.routed_experts is None or out.prompt_routed_experts is None
        if ctx.return_routed_experts and missing and out.finish_reason != "abort":  # aborted: dropped anyway
            raise EngineError(
                f"engine {route.engine.url} returned no routed experts although the request asked for them "
                "(return_routed_experts): is the model MoE, and was an SGLang server started with "
                "--enable-return-routed-experts?"
            )
    sample.response_ids = list(out.output_ids)
    sample.rollout_logprobs = list(out.output_logprobs)
    sample.loss_mask = [1] * len(out.output_ids)
    sample.weight_versions = out.token_versions(served_at_start)
    sample.routed_experts = out.routed_experts
    sample.prompt_routed_experts = out.prompt_routed_experts
    sample.finish_reason = out.finish_reason
    sample.status = _FINISH_STATUS.get(out.finish_reason, Status.FAILED)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample
