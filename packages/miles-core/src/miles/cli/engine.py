"""``miles engine generate URL``: one raw ``/generate`` request, its answer and per-token log-probs."""

from __future__ import annotations

import json
from typing import Any

import click

from miles.cli._common import verbose_option


@click.group()
def engine() -> None:
    """Talk to a running engine: one raw /generate request.

    Works against the embedded engine and SGLang alike (the same /generate API).
    """


@engine.command()
@click.argument("url")
@click.option("--prompt", help="prompt text, tokenized with --model's tokenizer")
@click.option("--input-ids", help="the prompt as comma-separated token ids instead of text")
@click.option("--model", help="model path or builtin:NAME whose tokenizer encodes and decodes")
@click.option("--chat/--no-chat", default=False, help="wrap --prompt as one user turn of the chat template")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the engine's raw answer")
@verbose_option
def generate(
    url: str,
    prompt: str | None,
    input_ids: str | None,
    model: str | None,
    chat: bool,
    max_new_tokens: int,
    temperature: float,
    as_json: bool,
) -> None:
    """Send one request to URL's /generate and print the answer, token by token, with log-probs."""
    import httpx

    from miles.engines.client import generate_call, normalize_url, parse_generate_response
    from miles.types import SamplingParams

    if (prompt is None) == (input_ids is None):
        raise click.UsageError("give exactly one of --prompt and --input-ids")
    tokenizer = _tokenizer(model) if model else None
    if input_ids is not None:
        ids = [int(t) for t in input_ids.replace(" ", "").split(",") if t]
    elif tokenizer is None:
        raise click.UsageError("--prompt needs --model (the tokenizer): the engine takes token ids")
    elif chat:
        turn = [{"role": "user", "content": prompt}]
        ids = list(
            tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    else:
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    call = generate_call(ids, params)
    base = normalize_url(url)
    answer = httpx.post(f"{base}{call.path}", json=call.body, timeout=120).raise_for_status().json()
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    out = parse_generate_response(answer, prompt_len=len(ids), url=base)
    text = out.text or None
    if text is None and tokenizer is not None:
        text = tokenizer.decode(out.output_ids)
    click.echo(
        f"prompt: {len(ids)} tokens; answer: {len(out.output_ids)} tokens, finish: {out.finish_reason}, "
        f"weight version: {out.weight_version}"
    )
    if text is not None:
        click.echo(f"text: {text!r}")
    click.echo(f"{'pos':>4} {'token':>8} {'logprob':>10}  piece")
    for pos, (tok, lp) in enumerate(zip(out.output_ids, out.output_logprobs, strict=True)):
        piece = tokenizer.decode([tok]) if tokenizer is not None else ""
        click.echo(f"{pos:>4} {tok:>8} {lp:>10.4f}  {piece!r}")


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from miles.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))
