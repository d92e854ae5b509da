"""The shared model's quality on held-out data: what an operator judges a run by.

The shared model is the fragments' outer parameters ``G`` (bit-identical on every peer that applied the same
rounds), not this peer's weights θ, which wander between syncs. :class:`SharedEval` evaluates it on
``run.eval_sequences`` held-out sequences (``TokenSource.held_out``: the corpus' last ``data.holdout`` tokens, or
the synthetic corpus' own held-out stream; the same sequences every time, on every peer) after every
``run.eval_every`` applied rounds of fragment 0. So two peers whose ``eval`` events name the same digests report
the same loss (to the device's reduction order).

:func:`shared_params` gives ``G`` to the model through ``torch.func.functional_call``: the model's parameters, its
optimizer and the data cursor are untouched; on a GPU the evaluation holds one more copy of the parameters on the
device while it runs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from peer.errors import SetupError
from peer.local.data import make_source
from peer.local.inner import InnerLoop, mean_ce
from peer.outer.fragments import Fragment
from peer.run.export import SavedRun, provenance, run_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the shared model: the mean cross-entropy (nats) and perplexity on the held-out
    sequences, the rounds and digests of the fragments it was made of."""

    loss: float
    rounds: list[int]
    digests: list[str]
    sequences: int
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # (exp overflows past ~709)


def shared_params(fragments: Sequence[Fragment], flats: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{parameter name: its values in ``flats`` (one fp32 vector per fragment, as ``Fragment.flat``)} on each
    parameter's device and dtype: the argument :meth:`InnerLoop.evaluate` takes."""
    out: dict[str, torch.Tensor] = {}
    for frag, flat in zip(fragments, flats, strict=True):
        if flat.numel() != frag.numel:
            raise ValueError(f"fragment {frag.index}: {flat.numel()} values for {frag.numel} parameters")
        offset = 0
        for name, p in zip(frag.names, frag.params):
            out[name] = flat[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
    return out


class SharedEval:
    """Evaluates ``G`` every ``every`` applied rounds of fragment 0 (:meth:`maybe`, from the training thread,
    its one caller). ``batch``: the held-out sequences (None: no held-out data, nothing is evaluated)."""

    def __init__(self, inner: InnerLoop, fragments: Sequence[Fragment], batch: Optional[torch.Tensor], *,
                 every: int, report: Callable[[Evaluation], None]):
        self.inner, self.fragments, self.batch = inner, list(fragments), batch
        self.every, self.report = every, report
        self.last: Optional[Evaluation] = None
        self._done_at = -1  # fragment 0's applied round at the last evaluation

    def due(self, applied_round: int) -> bool:
        """Whether fragment 0's applied round ``applied_round`` calls for an evaluation: it reached a multiple of
        ``every`` not evaluated yet (rounds applied by a download count: the state is the swarm's)."""
        return (self.batch is not None and self.every > 0 and applied_round > 0
                and applied_round // self.every > max(self._done_at, 0) // self.every)

    def maybe(self, states: Sequence, digests: Callable[[int], str]) -> Optional[Evaluation]:
        """Evaluates if :meth:`due` (``states``: the fragments' ``FragmentState``; ``digests(p)``: fragment p's
        digest) and reports it; returns the evaluation, or None."""
        applied = states[0].last_applied
        if not self.due(applied):
            return None
        self._done_at = applied
        assert self.batch is not None
        loss = self.inner.evaluate(self.batch, shared_params(self.fragments, [st.G for st in states]))
        result = Evaluation(loss, [st.last_applied for st in states], [digests(p) for p in range(len(states))],
                            self.batch.shape[0], self.batch.shape[0] * (self.batch.shape[1] - 1))
        self.last = result
        self.report(result)
        return result


def evaluate_checkpoint(saved: SavedRun, *, data_paths: Optional[Sequence[str]] = None, sequences: int = 256,
                        weights: str = "shared") -> Evaluation:
    """``swarm-peer eval``: the held-out loss of a checkpoint's model (``weights`` as ``export.run_model``) on the
    held-out part (``data.holdout``) of the run's data, or of ``data_paths`` read the way the run reads its own.
    :class:`SetupError` (one line) for anything to fix."""
    if not 1 <= sequences <= 65536:
        raise SetupError("--sequences must be in [1, 65536]")
    d, seq_len = saved.cfg.data, saved.cfg.model.seq_len
    try:
        source = make_source(d.source, paths=list(data_paths or d.paths), vocab_size=d.vocab_size, seed=d.seed,
                             shard_index=0, holdout=d.holdout)
        batch = source.held_out(sequences, seq_len)
    except (ValueError, OSError) as e:
        raise SetupError(f"data: {e}") from None
    if batch is None:
        raise SetupError(f"data: data.holdout = {d.holdout} of {getattr(source, 'label', d.source)} holds out fewer "
                         f"tokens than one sequence (model.seq_len + 1 = {seq_len + 1})")
    model = run_model(saved, weights)
    loss = mean_ce(model, batch, chunk=d.micro_batch or d.batch_size)
    frags = provenance(saved, weights)["fragments"]
    return Evaluation(loss, [f["round"] for f in frags], [f["digest"] for f in frags], batch.shape[0],
                      batch.shape[0] * (batch.shape[1] - 1))
