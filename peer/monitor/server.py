"""The operator's monitor (``swarm-peer monitor``): a DHT client that reads the run's progress records every
``period`` seconds and serves what they say as a small web page (``/``) and a JSON API (``/api/swarm``).

It publishes nothing, joins no group and holds no state of the model: it can run beside a bootstrap node or on
an operator's laptop. The page is one HTML file with its script inline (no asset from the internet); it asks the
JSON API every ``period`` seconds. The HTTP server serves those two paths to GET only, on 127.0.0.1 unless told
otherwise, and every request is bounded (a 10 s socket timeout, no request body read).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
from importlib import resources
from typing import Any, Optional

from hivemind.utils import get_dht_time

from peer.config import PeerConfig
from peer.monitor.view import LossHistory, snapshot
from peer.net.trust.auth import RunAccess
from peer.net.plumbing.dht import create_dht, shutdown_dht
from peer.net.probe import read_records
from peer.net.trust.progress import dht_security
from peer.net.swarm import swarm_key

log = logging.getLogger(__name__)
REQUEST_TIMEOUT_S = 10.0


class Monitor:
    """Create with the run's config; :meth:`start`, then :meth:`stop` (also on errors). ``access``: a pass in an
    authenticated run (the monitor joins its DHT as any peer must; records without a valid pass are not shown)."""

    def __init__(self, cfg: PeerConfig, *, host: str, port: int, period: float, access: Optional[RunAccess] = None):
        self.cfg, self.host, self.port, self.period, self.access = cfg, host, port, period, access
        self.run_key = swarm_key(cfg.swarm.run_id, cfg.run_hash(), cfg.outer.codec)
        self.run = dict(run_id=cfg.swarm.run_id, run_hash=cfg.run_hash(), period=period,
                        model="hf" if cfg.model.hf_config else cfg.model.preset)
        self.history = LossHistory()
        self.latest: dict[str, Any] = dict(run=self.run, peers=[], live_peers=0, fragments=[], history=[],
                                           error="no answer from the swarm yet")
        self._stop = threading.Event()
        self._dht = None
        self._http: Optional[http.server.ThreadingHTTPServer] = None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        assert self._http is not None, "Must be called after start()"
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> None:
        """Joins the DHT as a client (raises what :func:`~peer.net.plumbing.dht.create_dht` raises), then polls and
        serves. The DHT forks: it starts before any thread of ours."""
        sw = self.cfg.swarm
        validators, _, auth = dht_security(self.run_key, self.access)
        self._dht = create_dht(initial_peers=sw.initial_peers, host_maddrs=sw.host_maddrs, announce_maddrs=[],
                               identity_path=None, client_mode=True, record_validators=validators,
                               startup_timeout=sw.startup_timeout, wait_timeout=sw.dht_timeout,
                               join_timeout=sw.join_timeout, **auth)
        self._http = http.server.ThreadingHTTPServer((self.host, self.port), _handler(self))
        self._http.daemon_threads = True
        self._threads = [threading.Thread(target=self._poll, name="monitor-poll", daemon=True),
                         threading.Thread(target=self._http.serve_forever, name="monitor-http", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("monitor of run %s (hash %s) on %s", self.run["run_id"], self.run["run_hash"], self.url)

    def stop(self) -> None:
        """Stops the poller, the web server and the DHT client. Idempotent."""
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        for t in self._threads:
            t.join(timeout=self.cfg.swarm.dht_timeout * 2 + self.period)
        self._threads = []
        if self._dht is not None:
            shutdown_dht(self._dht)
            self._dht = None

    def poll_once(self) -> dict[str, Any]:
        """Reads the records once and replaces :attr:`latest`; returns it."""
        sw = self.cfg.swarm
        checker = self.access.checker if self.access else None
        try:
            records = read_records(self._dht, self.run_key, timeout=2 * sw.dht_timeout, checker=checker)
            self.latest = snapshot(records, get_dht_time(), sw.progress_ttl, self.history, self.run)
        except Exception as e:  # a DHT that does not answer: the page says so and keeps the last view
            self.latest = {**self.latest, "error": f"the swarm did not answer: {type(e).__name__} {e}"[:300]}
            log.warning("monitor: reading the records failed: %s: %s", type(e).__name__, e)
        return self.latest

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.period)


def _handler(monitor: Monitor) -> type[http.server.BaseHTTPRequestHandler]:
    page = resources.files("peer.monitor").joinpath("page.html").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # a client that sends nothing holds its thread this long at most

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/swarm":
                self._send(200, "application/json", json.dumps(monitor.latest).encode())
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
            log.debug("monitor http: " + format, *args)

    return Handler
