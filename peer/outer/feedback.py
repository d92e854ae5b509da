"""Error feedback of one peer's fragments: the codec's rounding error of what a round sent, added to the next
round's ``Delta`` (off by default; the sparse codecs need it).

:class:`Feedback` holds one :class:`~peer.outer.state.ErrorFeedback` per fragment and runs each round's update (a
codec round trip of what was sent) on the engine's worker. One writer at a time per residual: the worker while an
update of that fragment is submitted, the training thread once it was waited for (:meth:`Feedback.settle`, which
every method of the training thread that touches a residual calls first).

A residual belongs to the progress it carries: where a round delivered nothing, the residual from before its launch
is put back (:meth:`Feedback.restore`), and an adopted state drops it (:meth:`Feedback.reset`). A residual is
replaced, never written in place, so a copy of it on the device (the device path's, made ahead by the worker:
:meth:`Feedback.prefetch`) is known to be current by the host tensor it was made from.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional

import torch

from peer.outer.codec import Codec, roundtrip
from peer.outer.device_state import wait_for
from peer.outer.offload import OuterWorker
from peer.outer.state import ErrorFeedback


class Feedback:
    """The error feedback of ``num_fragments`` fragments for ``codec``; updates run on ``worker``. Must be used from
    the training thread (the worker only runs what :meth:`sent` and :meth:`prefetch` submit)."""

    def __init__(self, num_fragments: int, codec: Codec, worker: OuterWorker,
                 mirror: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, Any]]] = None):
        """``mirror``: the device path's (:meth:`peer.outer.device_state.DeviceState.mirror`), run on the worker."""
        self.codec, self.worker, self.mirror = codec, worker, mirror
        self.terms = [ErrorFeedback() for _ in range(num_fragments)]
        self._updates: list[Optional[concurrent.futures.Future]] = [None] * num_fragments
        # per fragment, the worker's copy on the device of its residual: (the host residual, the copy, its event)
        self._copies: list[Optional[concurrent.futures.Future]] = [None] * num_fragments

    def compensate(self, p: int, delta: torch.Tensor) -> Optional[torch.Tensor]:
        """Adds fragment ``p``'s residual to ``delta`` in place, on ``delta``'s device (from the copy
        :meth:`prefetch` made where it is of this residual, else copied now); returns the residual it added (None:
        none), which a round keeps to :meth:`restore` it."""
        self.settle(p)
        before = self.terms[p].residual
        copy, self._copies[p] = self._copies[p], None
        made = copy.result() if copy is not None else None
        if (before is not None and made is not None and made[0] is before and made[1].device == delta.device
                and made[1].shape == delta.shape):
            residual, ready = made[1], made[2]
            if ready is not None:  # (made on the worker's stream: the add is ordered after it)
                stream = torch.cuda.current_stream(delta.device)
                stream.wait_event(ready)
                residual.record_stream(stream)
            torch.add(delta, residual, out=delta)
        else:
            self.terms[p].compensate(delta, out=delta)
        return before

    def prefetch(self, p: int) -> None:
        """(The device path.) Has the worker copy fragment ``p``'s residual to the device for its next launch, after
        the updates queued before; nothing where there is no ``mirror``. Must be called on the training thread."""
        if self.mirror is not None:
            self._copies[p] = self.worker.submit(self._copy, p)

    def _copy(self, p: int) -> Optional[tuple[torch.Tensor, torch.Tensor, Any]]:
        residual, mirror = self.terms[p].residual, self.mirror
        if residual is None or mirror is None:
            return None
        return (residual, *mirror(residual))

    def sent(self, p: int, delta: torch.Tensor, copied: Optional[Any] = None) -> None:
        """``delta`` (compensated) was handed to the transport, or (``copied``: the CUDA event after its copy to the
        host) will be: the worker computes what the peers will decode of it and keeps the difference as ``p``'s
        residual. ``delta`` must not change until :meth:`idle` says so."""
        self._updates[p] = self.worker.submit(self._update, p, delta, copied)

    def _update(self, p: int, sent: torch.Tensor, copied: Optional[Any]) -> None:
        wait_for(copied)
        self.terms[p].update(sent, roundtrip(sent, self.codec))

    def idle(self, p: int) -> bool:
        """Whether no update of fragment ``p`` is running or waiting (the worker runs them in order)."""
        update = self._updates[p]
        return update is None or update.done()

    def settle(self, p: Optional[int] = None) -> None:
        """Waits for the update of fragment ``p`` (all: None); raises what it raised."""
        for q in range(len(self.terms)) if p is None else (p,):
            update, self._updates[q] = self._updates[q], None
            if update is not None:
                update.result()

    def restore(self, p: int, before: Optional[torch.Tensor], where: Optional[torch.Tensor]) -> None:
        """Puts back ``before``, the residual from before a round's launch, where that round delivered nothing
        (``where``: a mask; None: everywhere). Must be called only while no later round of ``p`` is in flight: that
        one's residual was computed on top of this one's."""
        self.settle(p)
        ef = self.terms[p]
        if where is None or ef.residual is None:
            ef.residual = None if before is None else before.clone()
        elif before is None:
            ef.residual = ef.residual.masked_fill(where, 0.0)  # (a new tensor: see the module's docstring)
        else:
            ef.residual = torch.where(where, before.to(ef.residual.device), ef.residual)
        if self._copies[p] is not None:  # (a copy for the next launch was on its way: of the residual replaced)
            self.prefetch(p)

    def reset(self, p: int) -> None:
        """Drops fragment ``p``'s residual (its progress was dropped: an adopted state)."""
        self.settle(p)
        self.terms[p].reset()
        self._copies[p] = None

    def state_dict(self) -> list[dict]:
        self.settle()
        return [ef.state_dict() for ef in self.terms]

    def load_state_dict(self, state: list[dict]) -> None:
        for ef, saved in zip(self.terms, state):
            ef.load_state_dict(saved)
