"""The engine's outer state in a checkpoint (tensors and plain values only): what is saved, and what a restore
makes of it.

Per fragment: ``G``, ``v``, its round, the tokens since its last sync and its last applied rounds; the eager terms
``E`` and ``u`` only where the saving peer's settings use them (a peer that uses them and finds none starts them
from zero); ``S`` is derived. Rounds in flight are saved as what is needed to forget them on load (their weight and
eager jump): their aggregates cannot be waited for after a restart, so a restore counts them as missed. Also our
last share of each fragment's aggregate and the error feedback's residuals.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from peer.outer.feedback import Feedback
from peer.outer.inflight import Pending
from peer.outer.state import FragmentState


def save(states: Sequence[FragmentState], pending: Sequence[Sequence[Pending]], last_share: Sequence[Optional[float]],
         feedback: Optional[Feedback], terms: tuple[str, ...]) -> dict:
    """The checkpoint's dict; ``terms``: the state's tensors this peer's settings keep (``G``, ``v``, the eager
    terms)."""
    return {
        "fragments": [dict({k: getattr(st, k) for k in terms}, round=st.round,
                           tokens_since_sync=st.tokens_since_sync, applied_rounds=st.applied_rounds[-64:])
                      for st in states],
        "pending": [[dict(round=pd.round, weight=pd.weight, jump=None if pd.jump is None else pd.jump.cpu())
                     for pd in q] for q in pending],
        "last_share": list(last_share),
        "error_feedback": None if feedback is None else feedback.state_dict(),
    }


def restore(state: dict, states: Sequence[FragmentState], feedback: Optional[Feedback],
            eager_terms: tuple[str, ...]) -> list[Optional[float]]:
    """Puts :func:`save`'s ``state`` into ``states`` and ``feedback``; returns the last shares. The rounds that were
    in flight (``state["pending"]``) are the caller's to forget. ValueError: a checkpoint of another model."""
    if len(state["fragments"]) != len(states):
        raise ValueError(f"checkpoint has {len(state['fragments'])} fragments, the model has {len(states)}")
    for st, saved in zip(states, state["fragments"]):
        if saved["G"].shape != st.G.shape:
            raise ValueError(f"checkpoint fragment of {saved['G'].numel()} elements, model has {st.G.numel()}")
        st.G, st.v = saved["G"].clone(), saved["v"].clone()  # (an older checkpoint's S equals G or G + E)
        # absent when the saving peer did not use them (zero); a peer that does starts them from zero
        st.E, st.u = ((saved[k].clone() if k in saved else torch.zeros_like(st.G)) if k in eager_terms
                      else None for k in ("E", "u"))
        st.round, st.tokens_since_sync = saved["round"], saved["tokens_since_sync"]
        st.applied_rounds = list(saved["applied_rounds"])
    if feedback is not None and state.get("error_feedback"):
        feedback.load_state_dict(state["error_feedback"])
    return list(state["last_share"])
