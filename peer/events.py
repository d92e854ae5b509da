"""What a peer reports: the JSON-lines event log and the human console status line.

JSON events (one object per line, ``--log-json``): ``start``, ``step`` (every ``log_every`` steps:
step, loss, ce, tokens, time, ...), ``round`` (after each sync: fragment, round, status,
group_size, bytes_sent, bytes_received, seconds, digest, spans_applied, spans_missing, ...),
``catch_up``, ``resume`` and ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional


class EventLog:
    """Appends one JSON object per line; flushed per event so other processes can follow it."""

    def __init__(self, path: Optional[str]):
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def setup_logging(level: str, log_file: Path, peer_label: str) -> None:
    """Console (stderr) and file logging; every line names the peer."""
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s [{peer_label}] %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(log_file)):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    for noisy in ("hivemind", "asyncio"):  # hivemind logs matchmaking chatter at INFO
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("asyncio").addFilter(_drop_hivemind_leaked_waits)
    # Advice we follow on purpose (group sizes that are not powers of 2; request vs matchmaking
    # timeouts are validated in peer/config.py) is not worth a warning every round.
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


class StatusLine:
    """A compact live status line: rewritten in place on a terminal, a log line otherwise."""

    def __init__(self, interval: float, peer_label: str):
        self.interval, self.peer_label = interval, peer_label
        self._last = 0.0
        self._tty = sys.stderr.isatty() and os.environ.get("TERM") != "dumb"

    def maybe_show(self, *, step: int, loss: float, floor: Optional[float], tok_s: float, peers: int,
                   next_sync: str, up: int, down: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.interval <= 0 or (not force and now - self._last < self.interval):
            return
        self._last = now
        floor_txt = f" (floor {floor:.3f})" if floor is not None else ""
        line = (f"[{self.peer_label}] step {step} loss {loss:.4f}{floor_txt} {tok_s:,.0f} tok/s peers {peers} "
                f"next sync {next_sync} up {fmt_bytes(up)} down {fmt_bytes(down)}")
        if self._tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        else:
            logging.getLogger("peer.status").info(line)
