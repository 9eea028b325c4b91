"""Call every engine at once and judge the answers together.

A weight update talks to all engines in parallel (each request may block while its
engine receives tensors), then waits for every answer. Any failure (unreachable
engine, HTTP error, ``success: false``) becomes one ``EngineError`` that names every
engine that failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from miles.engines.client import SyncEngineClient
from miles.errors import EngineError


class EngineFanout:
    def __init__(self, urls: Sequence[str], timeout_s: float, name: str = "miles-weights") -> None:
        self.clients = [SyncEngineClient(url, timeout=timeout_s) for url in urls]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)), thread_name_prefix=name)

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def submit(
        self, method: str, *args: Any, per_engine: Sequence[dict[str, Any]] | None = None, **kwargs: Any
    ) -> list[Future]:
        """Start ``client.<method>(*args, **kwargs)`` on every engine (plus that engine's ``per_engine`` kwargs)."""
        futures = []
        for i, client in enumerate(self.clients):
            extra = per_engine[i] if per_engine is not None else {}
            futures.append(self._pool.submit(getattr(client, method), *args, **kwargs, **extra))
        return futures

    def gather(self, futures: Sequence[Future], what: str, timeout_s: float | None = None) -> list[Any]:
        answers: list[Any] = []
        errors: list[str] = []
        for client, fut in zip(self.clients, futures, strict=True):
            try:
                answers.append(fut.result(timeout=timeout_s))
            except EngineError as exc:
                errors.append(str(exc))
            except TimeoutError:
                errors.append(f"engine {client.url}: no answer to {what} within {timeout_s} s")
            except Exception as exc:
                errors.append(f"engine {client.url}: {what} raised {type(exc).__name__}: {exc}")
        if errors:
            raise EngineError(
                f"{what} failed on {len(errors)} of {len(self.clients)} engine(s): " + "; ".join(errors)
            )
        return answers

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.gather(self.submit(method, *args, **kwargs), method)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()
