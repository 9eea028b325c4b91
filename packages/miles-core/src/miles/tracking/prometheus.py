"""A Prometheus scrape endpoint for long jobs (``pip install 'miles-core[prometheus]'``).

Serves the latest step's metrics as gauges at ``http://<host>:<port>/metrics``: each metric
name with non-alphanumerics replaced by ``_`` and prefixed ``miles_`` (``rollout/reward_mean``
-> ``miles_rollout_reward_mean``), labelled with the run's name, plus ``miles_step``. Host
defaults to 127.0.0.1 (a metrics port is not for the open internet); ``port: 0`` takes a free
port. The address actually bound is written to ``prometheus_address`` in the run directory.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.tracking.base import TrackerContext, finite_scalars, write_run_id

ADDRESS_FILE = "prometheus_address"


class PrometheusOptions(ComponentOptions):
    host: str = Field("127.0.0.1", description="address to bind the endpoint to")
    port: int = Field(9464, ge=0, le=65535, description="port of the endpoint; 0: a free one")


def metric_name(key: str) -> str:
    return "miles_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _LatestCollector:
    """Yields the latest values at scrape time: no gauge objects to create per new metric name."""

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self._lock = threading.Lock()  # scrapes come on the server's thread
        self._values: dict[str, float] = {}

    def update(self, values: dict[str, float]) -> None:
        with self._lock:
            self._values.update(values)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            values = dict(self._values)
        for name, value in sorted(values.items()):
            family = GaugeMetricFamily(name, f"Miles metric {name}", labels=["run"])
            family.add_metric([self.run_name], value)
            yield family


class PrometheusTracker:
    Options = PrometheusOptions
    requires: ClassVar[tuple[str, ...]] = ("prometheus_client",)
    install: ClassVar[str] = "miles-core[prometheus]"
    background: ClassVar[bool] = True  # called from its own thread (miles.tracking.registry)

    def __init__(self, ctx: TrackerContext, options: PrometheusOptions) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry of its own: the process-wide default one would mix in other runs and libraries.
        self.registry = CollectorRegistry()
        self.collector = _LatestCollector(ctx.run_name)
        self.registry.register(self.collector)
        self._server, self._thread = start_http_server(
            options.port, addr=options.host, registry=self.registry
        )
        host, port = self._server.server_address[:2]
        self.address = f"{host!s}:{port}"
        write_run_id(os.path.join(ctx.run_dir, ADDRESS_FILE), self.address)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {metric_name(k): v for k, v in finite_scalars(metrics).items()}
        values["miles_step"] = float(step)
        self.collector.update(values)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.collector.update({metric_name(k): v for k, v in finite_scalars(metrics).items()})

    def close(self, status: str) -> None:
        self._server.shutdown()
        self._server.server_close()
