"""What a peer's run saves and restores (the file format: peer/run/checkpoint.py): the model, the inner optimizer,
the data position, the outer engine, the RNG, with the resolved config and its run hash, so that the run dir
alone describes the run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from peer.config import PeerConfig
from peer.errors import SetupError
from peer.run import checkpoint
from peer.run.events import EventLog

log = logging.getLogger(__name__)


class RunCheckpoints:
    """The checkpoints of one run dir. :meth:`find` before joining, :meth:`restore` once the parts are built,
    :meth:`save` from the training loop."""

    def __init__(self, cfg: PeerConfig, run_dir: Path, events: EventLog):
        self.cfg, self.folder, self.events = cfg, run_dir / "checkpoints", events  # events: set again by the trainer
        self._found: Optional[tuple[Path, dict[str, Any]]] = None
        self._failures = 0  # in a row (a full disk): the first is a warning, the others DEBUG

    def find(self, run_hash: str) -> None:
        """Reads the newest good checkpoint (kept for :meth:`restore`). Raises SetupError when it belongs to another
        run (another run hash): before joining, so the user gets one line."""
        self._found = checkpoint.load_latest(self.folder)
        if self._found is not None and self._found[1].get("run_hash") != run_hash:
            raise SetupError(f"--run-dir {self.folder.parent} holds a checkpoint of another run (run hash "
                             f"{self._found[1].get('run_hash')}, this config's is {run_hash}): use another --run-dir")

    def save(self, step: int, *, model, inner, source, engine) -> bool:
        """Saves everything needed to resume (atomic). A write that fails (a full disk) is a warning, not the end of
        the run: the previous checkpoint stays; returns whether this one was written. Raises the inner loop's
        ``FloatingPointError`` instead if one of its steps was not finite (deferred checks: see InnerLoop)."""
        inner.check_finite()
        payload = {"format": 1, "run_hash": self.cfg.run_hash(), "config": self.cfg.to_dict(), "step": step,
                   "model": model.state_dict(), "inner": inner.state_dict(), "data": source.state_dict(),
                   "engine": engine.state_dict(), "torch_rng": torch.get_rng_state()}
        try:
            path = checkpoint.save(self.folder, step, payload, keep=self.cfg.run.checkpoint_keep)
        except OSError as e:
            kept = checkpoint.newest(self.folder)
            (log.debug if self._failures else log.warning)(
                "checkpoint at step %d not written (%s); keeping %s and training on; trying again later", step,
                e.strerror or e, kept.name if kept else "no earlier checkpoint")
            self._failures += 1
            self.events.emit("checkpoint_failed", step=step, error=str(e))
            return False
        again = f" (written again after {self._failures} failed tries)" if self._failures else ""
        self._failures = 0
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
