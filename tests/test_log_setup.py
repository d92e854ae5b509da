"""The peer's logging setup (peer/run/events.py): what a user at --log-level DEBUG reads is the peer's own detail."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from peer.run.events import setup_logging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restored_logging():
    """setup_logging configures the root logger and some libraries' loggers: put them back afterwards."""
    names = ["", "hivemind", "asyncio", "numba"]
    saved = {n: logging.getLogger(n).level for n in names}
    handlers = list(logging.getLogger().handlers)
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    for n, level in saved.items():
        logging.getLogger(n).setLevel(level)


def test_debug_shows_the_peers_detail_and_not_the_libraries_internals(tmp_path, restored_logging):
    setup_logging("DEBUG", tmp_path / "peer.log", "peer test")
    assert logging.getLogger("peer.net.round.round_runner").isEnabledFor(logging.DEBUG)
    for internal in ("numba.core.byteflow", "numba.core.ssa", "hivemind.dht.node", "asyncio"):
        assert not logging.getLogger(internal).isEnabledFor(logging.INFO), internal
        assert logging.getLogger(internal).isEnabledFor(logging.WARNING), internal


def test_the_codec_kernels_load_without_a_debug_line(tmp_path):
    """In a fresh process (as a peer starts): the kernels compile or load from numba's cache, at DEBUG, and the
    log has the peer's lines only."""
    log = tmp_path / "peer.log"
    script = ("import logging, sys; from pathlib import Path; from peer.run.events import setup_logging; "
              "from peer.outer import codec, cpu_path; "
              "setup_logging('DEBUG', Path(sys.argv[1]), 'peer test'); codec.warm_up('e3m0'); "
              "logging.getLogger('peer.test').debug('kernels %s', cpu_path.kernels() is not None)")
    done = subprocess.run([sys.executable, "-c", script, str(log)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert "peer.test: kernels True" in text, text[-2000:]
    assert "numba" not in text, [line for line in text.splitlines() if "numba" in line][:5]


def test_every_line_of_the_log_names_the_peer_even_for_a_message_with_line_breaks(tmp_path, restored_logging):
    """libp2p's dial errors list one address per line: a span's "missing and NOT applied" warning ended on a
    continuation line without the peer's name (and a reader of single lines missed its end)."""
    setup_logging("INFO", tmp_path / "peer.log", "peer test")
    log = logging.getLogger("peer.net.round.allreduce")
    log.warning("fragment 0 round 2: span 1 is missing: %s (every list agrees)",
                "Undialable: failed to dial: all dials failed\n  * [/ip4/127.0.0.1/tcp/1] connection refused")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("a round failed")
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = (tmp_path / "peer.log").read_text().splitlines()
    assert lines[0].endswith("span 1 is missing: Undialable: failed to dial: all dials failed | * [/ip4/127.0.0.1/"
                             "tcp/1] connection refused (every list agrees)"), lines[0]
    assert "[peer test]" in lines[0] and "[peer test]" in lines[1] and lines[1].endswith("a round failed")
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"  # (as before)
