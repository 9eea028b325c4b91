"""``miles serve session-server``: the session server on its own, for agents developed outside a run."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from miles.cli._common import verbose_option


@click.group()
def serve() -> None:
    """Run the session server on its own, for agents developed outside a run."""


@serve.command("session-server")
@click.option("--family", required=True, help="the model family that renders the chat and parses replies")
@click.option("--engine", "engines", multiple=True, required=True, help="engine URL (repeat for several)")
@click.option("--model", help="model path or builtin:NAME whose tokenizer to use (default: the family's own)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=int, default=8000, show_default=True, help="port to bind (0: a free one)")
@click.option("--mode", type=click.Choice(["linear", "branching"]), default="linear", show_default=True)
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="a turn's token limit")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--max-seq-len", type=int, help="prompt + replies per session (default: no limit)")
@verbose_option
def session_server(
    family: str,
    engines: tuple[str, ...],
    model: str | None,
    host: str,
    port: int,
    mode: str,
    max_new_tokens: int,
    temperature: float,
    max_seq_len: int | None,
) -> None:
    """Serve sessions over the engines at --engine until interrupted (Ctrl-C or SIGTERM).

    An agent creates a session (POST /sessions) and points any OpenAI client at its base_url;
    GET /sessions/{id}/trajectory shows the tokens, loss mask and log-probs a run would train on.
    """
    from miles.engines.client import SGLangClient, normalize_url
    from miles.types import SamplingParams
    from miles_envs.families import get_family
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    chosen = get_family(family)
    state = ServerState(
        store=SessionStore(mode=mode),  # type: ignore[arg-type]  # click.Choice checked it
        family=chosen,
        tokenizer=_tokenizer(chosen, model),
        engines=[SGLangClient(normalize_url(url)) for url in engines],  # the /generate API of both kinds
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
        max_seq_len=max_seq_len,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with session_service(state, host=host, port=port) as service:
        click.echo(f"session server for family {chosen.name!r} on {service.url}", err=False)
        click.echo(f"  POST {service.url}/sessions, then an OpenAI client at its base_url", err=False)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass


def _tokenizer(family: Any, model: str | None) -> Any:
    if model is None:
        from miles_envs.families.artefacts import family_tokenizer

        return family_tokenizer(family.name, family.artefacts)
    from miles.cli.engine import _tokenizer as model_tokenizer

    return model_tokenizer(model)
