"""What a peer reports: the JSON-lines event log and its console/file logging (the status line: peer/run/status.py).

JSON events (one object per line, ``--log-json``): ``start``, ``step`` (every ``log_every`` steps:
step, loss, ce, tokens, time, ...), ``round`` (after each sync: fragment, round, status,
group_size, bytes_sent, bytes_received, seconds, digest, spans_applied, spans_missing, ...),
``eval`` (the shared model on held-out data, every ``run.eval_every`` rounds: loss, perplexity, rounds,
digests; peer/run/evaluation.py), ``catch_up``, ``resume`` and ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class EventLog:
    """Appends one JSON object per line, written at once so other processes can follow it.

    A write that fails (a full disk: ENOSPC, EFBIG, EIO) loses that event, never the peer: the first
    failure is logged as a warning, the events are dropped until a write succeeds again (it is retried
    with every event), and the first line after a failure starts on a new line, so a line cut short by
    the full disk stays a line of its own that readers skip.

    Two threads emit (the training thread, and the checkpoint writer when a write fails): one lock orders their
    lines and guards the file and the drop counters.
    """

    def __init__(self, path: Optional[str], feed: Optional[Callable[[str], None]] = None):
        """``path``: the file (None: no file); ``feed``: also given every event's JSON (the control API's
        WatchEvents)."""
        self._lock = threading.RLock()  # (open closes under it too)
        self._fd: Optional[int] = None
        self.path: Optional[str] = None
        self.feed: Optional[Callable[[str], None]] = None
        self.dropped = 0  # events lost to write errors since the last successful write
        self._cut = False  # the last write may have ended mid-line
        self.open(path, feed)

    def open(self, path: Optional[str], feed: Optional[Callable[[str], None]] = None) -> None:
        """Writes to ``path`` and ``feed`` from now on (as the constructor's), closing the file written so far: a log
        made before its run dir was ours (the trainer's) is opened in place, so whoever holds it emits there."""
        with self._lock:
            self.close()
            self.path, self.feed = path, feed
            self.dropped, self._cut = 0, False
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._emit(event, fields)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self._fd is None and self.feed is None:
            return
        text = json.dumps({"event": event, "time": time.time(), **fields})
        if self.feed is not None:
            self.feed(text)
        if self._fd is None:
            return
        line = ("\n" if self._cut else "") + text + "\n"
        data = line.encode()
        try:
            while data:
                self._cut = True
                data = data[os.write(self._fd, data):]
        except OSError as e:
            if not self.dropped:
                log.warning("event log %s: cannot write (%s); events are dropped until it works again",
                            self.path, e.strerror or e)
            self.dropped += 1
            return
        self._cut = False
        if self.dropped:
            log.warning("event log %s: writing again, %d event(s) were lost", self.path, self.dropped)
            self.dropped = 0

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class _ForgivingFileHandler(logging.FileHandler):
    """A log file that tolerates a full disk: a failed write is reported once on stderr (logging's default
    prints a traceback per line) and every later line is tried again."""

    _failing = False  # the last write failed
    _failed_now = False  # handleError ran during the current emit

    def emit(self, record: logging.LogRecord) -> None:
        self._failed_now = False
        super().emit(record)
        if self._failing and not self._failed_now:
            self._failing = False
            sys.stderr.write(f"swarm-peer: the log file {self.baseFilename} is written again\n")

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last flush on a full disk: those lines are on the console already
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        self._failed_now = True
        if not self._failing:
            self._failing = True
            sys.stderr.write(f"swarm-peer: warning: cannot write the log file {self.baseFilename} "
                             f"({sys.exc_info()[1]}); its lines go to the console only until it works again\n")


class _OneLine(logging.Formatter):
    """Each record's message on one line, so that every line of the log names the peer (logs are read line by line:
    grep, the tests, an operator's tools). A message with line breaks (libp2p's dial errors list one address per
    line) has each shown as " | "; a traceback still follows its record on lines of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return " | ".join(line.strip() for line in super().formatMessage(record).splitlines() if line.strip())


def setup_logging(level: str, log_file: Path, peer_label: str) -> None:
    """Console (stderr) and file logging; every line names the peer (:class:`_OneLine`)."""
    fmt = _OneLine(f"%(asctime)s %(levelname)s [{peer_label}] %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.StreamHandler(sys.stderr), _ForgivingFileHandler(log_file)):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    # hivemind logs matchmaking chatter at INFO; numba's compiler dumps bytecode at DEBUG (hundreds of lines while
    # the codec kernels load at start)
    for noisy in ("hivemind", "asyncio", "numba"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("asyncio").addFilter(_drop_hivemind_leaked_waits)
    # Advice we follow on purpose (group sizes that are not powers of 2; request vs matchmaking
    # timeouts are validated in peer/config/network.py) is not worth a warning every round.
    for chatty in ("hivemind.averaging.key_manager", "hivemind.averaging.matchmaking"):
        logging.getLogger(chatty).setLevel(logging.ERROR)


def _drop_hivemind_leaked_waits(record: logging.LogRecord) -> bool:
    # hivemind's PotentialLeaders leaves `Event.wait()` helper tasks pending after every search;
    # they are harmless but asyncio reports each one at ERROR when it is garbage-collected.
    msg = record.getMessage()
    return not ("Task was destroyed but it is pending" in msg and "Event.wait()" in msg)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"
