"""The opt-in Prometheus endpoint (``run.metrics_port``): the figures of the control API's ``Status``, named by
Prometheus conventions (``swarmloco_`` prefix, ``_total`` counters, base units), collected at each scrape from
the same snapshot ``Status`` reads. It listens on ``run.metrics_host`` (127.0.0.1 unless the owner opens it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Optional

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from peer.control.controls import Controls, PeerState

log = logging.getLogger(__name__)

# (name, help, key of the status fields): plain gauges
GAUGES = [
    ("step", "Inner steps made.", "step"),
    ("loss", "Latest training cross-entropy.", "loss"),
    ("tokens_per_second", "Training throughput over the last log window.", "tokens_per_second"),
    ("live_peers", "Live peers of the run, this one included (paused ones not counted).", "live_peers"),
    ("paused_peers", "Peers of the run whose records say they are paused.", "paused_peers"),
    ("tau", "Overlap tau in use (steps).", "tau"),
    ("host_peak_bytes", "Peak resident memory of the process (bytes).", "host_peak_bytes"),
    ("device_peak_bytes", "Peak GPU memory allocated by torch (bytes).", "device_peak_bytes"),
    ("uptime_seconds", "Seconds since the peer started.", "uptime_seconds"),
    ("idle_seconds", "Seconds since the last inner step.", "idle_seconds"),
    ("eval_loss", "Held-out cross-entropy of the shared model at its last evaluation (nats).", "eval_loss"),
    ("eval_perplexity", "Held-out perplexity of the shared model at its last evaluation.", "eval_perplexity"),
    ("eval_round", "Fragment 0's round the last evaluation of the shared model was made at.", "eval_round"),
]
COUNTERS = [
    ("sent_bytes", "All-reduce bytes sent.", "bytes_up"),
    ("received_bytes", "All-reduce bytes received.", "bytes_down"),
]


class StatusCollector(Collector):
    """Turns one status snapshot into metric families at each scrape."""

    def __init__(self, status_fn: Callable[[], dict[str, Any]], controls: Controls):
        self.status_fn, self.controls = status_fn, controls

    def collect(self) -> Iterator[Metric]:
        s = self.status_fn()
        for name, doc, key in GAUGES:
            value = s.get(key)
            if value is not None:
                yield GaugeMetricFamily(f"swarmloco_{name}", doc, value=float(value))
        for name, doc, key in COUNTERS:
            yield CounterMetricFamily(f"swarmloco_{name}", doc, value=float(s.get(key, 0)))
        rounds = CounterMetricFamily("swarmloco_rounds", "Rounds by status since start.", labels=["status"])
        for status, n in sorted(s.get("rounds_by_status", {}).items()):
            rounds.add_metric([status], float(n))
        yield rounds
        frag = GaugeMetricFamily("swarmloco_fragment_round", "Rounds applied to each fragment's shared state.",
                                 labels=["fragment"])
        for f in s.get("fragments", []):
            frag.add_metric([str(f["index"])], float(f["round"]))
        yield frag
        state = GaugeMetricFamily("swarmloco_state", "What the peer is doing (1 for the current state).",
                                  labels=["state"])
        current = self.controls.state()[0]
        for st in PeerState:
            state.add_metric([st.value], 1.0 if st is current else 0.0)
        yield state
        yield GaugeMetricFamily("swarmloco_excluded_peers", "Peers this one excluded from its rounds.",
                                value=float(len(s.get("excluded_peers", []))))
        limits = self.controls.limits.get()
        yield GaugeMetricFamily("swarmloco_duty_cycle_ratio", "Share of wall time the peer may train (0..1).",
                                value=limits.duty_cycle / 100.0)
        caps = GaugeMetricFamily("swarmloco_bandwidth_cap_bytes_per_second", "The owner's cap on the all-reduce and "
                                 "state-transfer streams (0 = none).", labels=["direction"])
        for direction, rate in zip(("upload", "download"), limits.byte_rates()):
            caps.add_metric([direction], rate)
        yield caps


class MetricsEndpoint:
    """Serves ``/metrics`` on ``host:port`` (port 0: any free one) until :meth:`stop`."""

    def __init__(self, status_fn: Callable[[], dict[str, Any]], controls: Controls):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(status_fn, controls))
        self._server: Optional[Any] = None
        self._thread: Optional[threading.Thread] = None
        self.port = 0

    def start(self, host: str, port: int) -> int:
        """Binds and serves in a thread of its own; returns the port. Raises OSError if it cannot bind."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
