"""One peer per run dir: an exclusive lock held for the life of the process.

Two processes started with the same ``--run-dir`` would share one identity (one peer id in the swarm),
append to one event log and write into one checkpoint folder. The first takes an exclusive ``flock`` on
``RUN_DIR/peer.lock`` and keeps it until it exits; the second finds it taken and refuses in one line.
The kernel releases the lock when the process dies in any way (kill -9 included), so a crash never
leaves a run dir locked; the pid written into the file only names the holder in that line.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "peer.lock"


class RunDirInUse(RuntimeError):
    """Another live process holds this run dir."""


class RunDirLock:
    """Holds ``RUN_DIR/peer.lock`` from :meth:`acquire` until :meth:`release` or the end of the process.

    The descriptor is inherited by forked children (the DHT process), which die with this process.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises :class:`RunDirInUse` naming the holder's pid. Creates the run dir."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(f"--run-dir {self.path.parent} is in use by another swarm-peer (pid {holder}): "
                              f"stop that one first, or give this one its own --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing our descriptor drops the lock (copies in dead children are gone)
            self._fd = None
