"""What a peer's run saves and restores (the file format: peer/run/checkpoint.py): the model, the inner optimizer,
the data position, the outer engine, the RNG, with the resolved config and its run hash, so that the run dir
alone describes the run."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Collection, Optional

import torch

from peer.config import PeerConfig
from peer.errors import SetupError
from peer.run import checkpoint
from peer.run.events import EventLog

log = logging.getLogger(__name__)
# A checkpoint that could not be written (a full disk) is tried again this often at most (seconds).
RETRY_S = 60.0


def detached(value: Any, shared: Collection[int] = ()) -> Any:
    """A copy of ``value`` (dicts, lists and tuples of tensors and plain values) that training cannot change any
    more: every tensor cloned to the CPU, except the CPU tensors whose ``id`` is in ``shared`` (never written in
    place: held as they are). (state_dict()s hold the live tensors.)"""
    if isinstance(value, torch.Tensor):
        if id(value) in shared and value.device.type == "cpu":
            return value
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: detached(v, shared) for k, v in value.items()}
    if type(value) in (list, tuple):  # (exactly: a named tuple's fields are not positional)
        return type(value)(detached(v, shared) for v in value)
    return value


class RunCheckpoints:
    """The checkpoints of one run dir. :meth:`find` before joining, :meth:`restore` once the parts are built,
    :meth:`save` from the training loop, :meth:`close` at the end (it owns the writer thread).

    With ``run.checkpoint_background`` (the default) the training thread only copies the state (memory
    speed) and a writer thread serializes, checksums, writes and fsyncs it: the step does not wait for the
    disk. One write at a time; a save asked for while one is being written replaces the one waiting, if any
    (the newest state is the one worth writing). The copy costs one checkpoint's size of host RAM while it
    waits to be written.
    """

    def __init__(self, cfg: PeerConfig, run_dir: Path, events: EventLog):
        self.cfg, self.folder, self.events = cfg, run_dir / "checkpoints", events  # (opened by the trainer in run())
        self._found: Optional[tuple[Path, dict[str, Any]]] = None
        self._failures = 0  # in a row (a full disk): the first is a warning, the others DEBUG
        self._retry_at: Optional[float] = None  # monotonic time to try again after a failed write (None: no failure)
        self._lock = threading.Condition()
        self._waiting: Optional[tuple[int, dict[str, Any]]] = None  # (step, payload) the writer takes next
        self._writing = False
        self._closed = False
        self._writer: Optional[threading.Thread] = None  # started by the first background save
        self._last: Optional[tuple[float, int]] = None  # (when, rounds done) at the policy's last save

    def find(self, run_hash: str) -> None:
        """Reads the newest good checkpoint (kept for :meth:`restore`). Raises SetupError when it belongs to another
        run (another run hash): before joining, so the user gets one line."""
        self._found = checkpoint.load_latest(self.folder)
        if self._found is not None and self._found[1].get("run_hash") != run_hash:
            raise SetupError(f"--run-dir {self.folder.parent} holds a checkpoint of another run (run hash "
                             f"{self._found[1].get('run_hash')}, this config's is {run_hash}): use another --run-dir")

    def save(self, step: int, *, model, inner, source, engine, wait: bool = False) -> None:
        """Saves everything needed to resume (atomic): in the background (``run.checkpoint_background``), or
        now with ``wait`` (a stop, a pause), after the write in progress. A write that fails (a full disk) is a
        warning, not the end of the run: the previous checkpoint stays, and :meth:`retry_due` says when to try
        again. Raises the inner loop's ``FloatingPointError`` instead if one of its steps was not finite
        (deferred checks: see InnerLoop). Must be called from the training thread, between steps."""
        inner.check_finite()
        payload = {"format": 1, "run_hash": self.cfg.run_hash(), "config": self.cfg.to_dict(), "step": step,
                   "model": model.state_dict(), "inner": inner.state_dict(), "data": source.state_dict(),
                   "engine": engine.state_dict(), "torch_rng": torch.get_rng_state()}
        if wait or not self.cfg.run.checkpoint_background:
            with self._lock:
                self._waiting = None  # (older than this one)
                while self._writing:
                    self._lock.wait()
                self._writing = True
            try:
                self._write(step, payload)
            finally:
                with self._lock:
                    self._writing = False
                    self._lock.notify_all()
            return
        # (the outer state's G, v are replaced, never written in place: the writer may hold them as they are)
        payload = detached(payload, {id(t) for t in engine.immutable_tensors()})
        with self._lock:
            if self._closed:
                return
            self._waiting = (step, payload)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_in_background, name="checkpoint-writer",
                                                daemon=True)
                self._writer.start()
            self._lock.notify_all()

    def save_if_due(self, step: int, *, rounds_done: int, applied: bool, **parts) -> bool:
        """The checkpoint policy: saves (in the background, as :meth:`save`) when ``run.checkpoint_minutes`` have
        passed, ``run.checkpoint_rounds`` more rounds are done (``rounds_done``; only once a round was
        ``applied``), or a failed write is due again; returns whether it saved. Its clocks start at its first
        call. Must be called from the training loop, between steps (``parts``: as :meth:`save`)."""
        now, run = time.monotonic(), self.cfg.run
        if self._last is None:
            self._last = (now, rounds_done)
        since, rounds_then = self._last
        minutes, every = run.checkpoint_minutes, run.checkpoint_rounds
        if not ((minutes and now - since >= 60 * minutes) or self.retry_due()
                or (every and applied and rounds_done - rounds_then >= every)):
            return False
        self.save(step, **parts)  # (a failed write is tried again: retry_due)
        self._last = (time.monotonic(), rounds_done)
        return True

    def busy(self) -> bool:
        """Whether a checkpoint is waiting to be written or being written."""
        with self._lock:
            return self._writing or self._waiting is not None

    def retry_due(self) -> bool:
        """Whether a failed write should be tried again now (and none is waiting or being written)."""
        with self._lock:
            return (self._retry_at is not None and time.monotonic() >= self._retry_at and not self._writing
                    and self._waiting is None)

    def close(self, timeout: Optional[float] = None) -> None:
        """Writes the checkpoint waiting, if any, and stops the writer thread (``timeout``: seconds to wait for
        it; None: until done: what is being written is the run's progress). Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def _write_in_background(self) -> None:
        while True:
            with self._lock:
                while self._waiting is None and not self._closed:
                    self._lock.wait()
                if self._waiting is None:  # closed, nothing left
                    return
                (step, payload), self._waiting = self._waiting, None
                self._writing = True
            try:
                self._write(step, payload)
            except Exception:  # (never let the writer die silently: the next save would wait for nothing)
                log.exception("checkpoint at step %d: the writer failed", step)
            finally:
                with self._lock:
                    self._writing = False
                    self._lock.notify_all()

    def _write(self, step: int, payload: dict[str, Any]) -> bool:
        try:
            path = checkpoint.save(self.folder, step, payload, keep=self.cfg.run.checkpoint_keep)
        except OSError as e:
            kept = checkpoint.newest(self.folder)
            (log.debug if self._failures else log.warning)(
                "checkpoint at step %d not written (%s); keeping %s and training on; trying again later", step,
                e.strerror or e, kept.name if kept else "no earlier checkpoint")
            self._failures += 1
            minutes = self.cfg.run.checkpoint_minutes
            self._retry_at = time.monotonic() + min(RETRY_S, 60 * minutes or RETRY_S)
            self.events.emit("checkpoint_failed", step=step, error=str(e))
            return False
        again = f" (written again after {self._failures} failed tries)" if self._failures else ""
        self._failures, self._retry_at = 0, None
        log.info("checkpoint at step %d: %s%s", step, path, again)
        return True

    def restore(self, *, model, inner, source, engine) -> int:
        """Restores the checkpoint :meth:`find` read (once); returns the step to continue from (0 without one)."""
        found, self._found = self._found, None
        if found is None:
            return 0
        path, state = found
        try:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            engine.load_state_dict(state["engine"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise SetupError(f"--run-dir {self.folder.parent}: {path.name} does not fit this model ({e}); "
                             f"use another --run-dir") from None
        try:
            source.load_state_dict(state["data"])
        except ValueError as e:  # data.* are this peer's own choice and may change between runs
            log.warning("the data changed since %s (%s): reading it from the start of this peer's shard",
                        path.name, e)
        torch.set_rng_state(state["torch_rng"])
        log.info("resumed from %s at step %d (rounds %s)", path.name, state["step"],
                 [st.round for st in engine.states])
        self.events.emit("resume", step=state["step"], checkpoint=str(path))
        return int(state["step"])
