"""The operator's monitor (peer/monitor/): what it computes from the progress records (pure), the JSON API and
the page in headless chromium on records made here. The monitor on a live swarm, in the browser, as peers pause and
leave: tests/test_control_swarm.py."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request

import pytest
from pydantic import ValidationError

from browser import browser_missing, headless_chromium, table_rows
from helpers import wait_for
from peer.monitor.view import LossHistory, snapshot
from peer.net.trust.records import ProgressRecord

NOW, TTL = 10_000.0, 8.0
PIDS = ["QmPeerAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaA", "QmPeerBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbB",
        "QmPeerCccccccccccccccccccccccccccccccccccccccccC", "QmPeerDddddddddddddddddddddddddddddddddddddddD"]


def record(i: int, *, age: float = 1.0, paused: bool = False, loss=3.0, rounds=(5, 4), digests=("aa", "bb"),
           version="0.1.0", client_mode=False, tps=100.0, eval_loss=None, eval_round=0) -> ProgressRecord:
    return ProgressRecord(peer_id=PIDS[i], step=100 + i, round=rounds[0], rounds=list(rounds), digests=list(digests),
                          tokens_per_second=tps, client_mode=client_mode, paused=paused, loss=loss, version=version,
                          time=NOW - age, eval_loss=eval_loss, eval_round=eval_round)


def test_the_held_out_loss_is_the_median_at_the_newest_evaluated_round():
    """One peer's word does not move it: the median of what the peers at the newest evaluated round report."""
    history = LossHistory()
    view = snapshot([record(0, eval_loss=2.0, eval_round=10), record(1, eval_loss=2.2, eval_round=10),
                     record(2, eval_loss=0.0, eval_round=10),  # a liar claims a perfect model
                     record(3, eval_loss=2.9, eval_round=5)], NOW, TTL, history, {})  # an older evaluation
    assert (view["eval_loss"], view["eval_round"]) == (2.0, 10) and history.data[-1][3] == 2.0
    assert view["peers"][0]["eval_loss"] == 2.0
    none = snapshot([record(0)], NOW, TTL, history, {})
    assert (none["eval_loss"], none["eval_round"]) == (None, 0) and history.data[-1][3] is None
    for bad in (float("nan"), -0.5, 1e7):
        with pytest.raises(ValidationError):
            record(0, eval_loss=bad)


def test_the_view_counts_live_peers_sums_tokens_and_checks_digests():
    records = [record(0, loss=3.0), record(1, loss=2.0, client_mode=True),
               record(2, paused=True, loss=9.0, tps=0.0),  # paused: listed, not in the loss or tokens/s
               record(3, age=TTL + 1, loss=1.0),  # expired: not shown at all
               record(1, age=5.0, loss=7.0)]  # an older record of peer 1 (it restarted): the newest one counts
    history = LossHistory(points=3)
    view = snapshot(records, NOW, TTL, history, dict(run_id="r"))
    assert [p["peer_id"] for p in view["peers"]] == PIDS[:3]
    assert (view["live_peers"], view["training_peers"], view["paused_peers"]) == (3, 2, 1)
    assert view["loss"] == pytest.approx(2.5) and view["tokens_per_second"] == 200.0
    assert view["peers"][1]["reachable"] is False and view["peers"][0]["last_seen_seconds"] == 1.0
    assert view["fragments"] == [dict(index=0, round=5, peers=3, digests=1, agree=True),
                                 dict(index=1, round=4, peers=3, digests=1, agree=True)]
    # one peer at the newest round with another digest: they differ
    split = snapshot([record(0), record(1, digests=("aa", "cc"))], NOW, TTL, history, {})
    assert split["fragments"][1] == dict(index=1, round=4, peers=2, digests=2, agree=False)
    # a peer ahead by a round: the newest round counts, with the peers at it
    ahead = snapshot([record(0, rounds=(6, 4)), record(1)], NOW, TTL, history, {})
    assert ahead["fragments"][0] == dict(index=0, round=6, peers=1, digests=1, agree=True)
    # the history keeps the last `points` points; json-ready
    assert len(history.data) == 3 and json.loads(json.dumps(ahead))["history"][-1][2] == 2


def test_records_refuse_a_loss_that_is_not_a_finite_number_and_a_long_version():
    for bad in (float("nan"), float("inf"), -1.0, 1e7):
        with pytest.raises(ValidationError):
            record(0, loss=bad)
    with pytest.raises(ValidationError):
        record(0, version="v" * 33)
    assert record(0, loss=None).loss is None  # before its first step


@pytest.fixture
def served():
    """The monitor's HTTP handler on 127.0.0.1 with a view set here (no DHT)."""
    from peer.monitor import server as monitor_server

    class Fake:
        latest: dict = {}

    fake = Fake()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), monitor_server._handler(fake))  # type: ignore
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def test_the_api_serves_the_view_and_nothing_else(served):
    fake, url = served
    fake.latest = snapshot([record(0)], NOW, TTL, LossHistory(), dict(run_id="r"))
    with urllib.request.urlopen(url + "api/swarm", timeout=10) as reply:
        assert json.loads(reply.read())["live_peers"] == 1
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert b"swarmloco monitor" in reply.read()
    with pytest.raises(urllib.request.HTTPError, match="404"):
        urllib.request.urlopen(url + "../etc/passwd", timeout=10)


@pytest.mark.skipif(bool(browser_missing()), reason=browser_missing() or "-")
def test_the_page_shows_the_peers_and_what_they_publish_as_text(served):
    fake, url = served
    hostile = '<img src=x onerror="document.title=1">'  # a version string is a peer's word: shown, never run
    history = LossHistory()
    for t in range(5):
        snapshot([record(0, loss=4.0 - t * 0.1)], NOW - 10 + t, TTL, history, {})
    run = dict(run_id="demo", run_hash="abc123", model="tiny")
    fake.latest = snapshot([record(0), record(1, version=hostile[:32]), record(2, paused=True)], NOW, TTL, history,
                           run)
    with headless_chromium() as driver:
        driver.get(url)
        rows = wait_for(lambda: table_rows(driver, "#peers tbody tr"), 20, "peer rows")
        assert len(rows) == 3
        assert driver.find_element("id", "live").text == "3" and driver.find_element("id", "paused").text == "1"
        assert [r[2] for r in rows] == ["training", "training", "paused"]
        assert rows[1][1] == hostile[:32] and driver.title == "swarmloco monitor"
        assert not driver.find_elements("css selector", "#peers img")
        assert len(driver.find_elements("css selector", "#chart polyline")) == 1
        # a peer leaves: the page follows at its next refresh
        fake.latest = snapshot([record(0), record(2, paused=True)], NOW + 1, TTL, history, run)
        wait_for(lambda: len(table_rows(driver, "#peers tbody tr")) == 2, 20, "two peer rows")
        assert driver.find_element("id", "live").text == "2"
