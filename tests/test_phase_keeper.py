"""The phase keeper (peer/run/phase.py) between the trainer's steps: it moves the step counter up to a lead that is far
ahead, asks the rule at most every ``CHECK_EVERY_S`` when asked with its default lag, and at once when told the lag."""

from __future__ import annotations

from peer.net.trust.records import ProgressRecord
from peer.outer.state import FragmentState
from peer.run import phase
from peer.run.phase import CHECK_EVERY_S, PhaseKeeper
from peer.util import Ema

import torch

H = 20


class Swarm:
    """The keeper's view of the swarm: one lead at ``step``, rounds (3, 3) like ours; counts the questions."""

    peer_id = "me"

    def __init__(self, step: int):
        self.step, self.questions = step, 0

    def vouched_peers(self) -> dict[str, ProgressRecord]:
        self.questions += 1
        lead = ProgressRecord(peer_id="lead", step=self.step, round=3, rounds=[3, 3], digests=["d", "d"],
                              tokens_per_second=1.0, client_mode=False, time=0.0)
        return {"lead": lead}


class Events:
    def __init__(self):
        self.told: list[dict] = []

    def emit(self, kind: str, **fields) -> None:
        self.told.append({"event": kind, **fields})


def states() -> list[FragmentState]:
    out = []
    for _ in range(2):
        st = FragmentState.from_params(torch.zeros(4), (), E_in_sync_point=False)
        st.applied_rounds = [3]
        out.append(st)
    return out


def test_the_default_question_is_asked_at_most_every_check_interval_and_a_told_lag_at_once(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(phase.time, "monotonic", lambda: now[0])
    swarm, events = Swarm(step=90), Events()
    keeper = PhaseKeeper(swarm, events, H=H, patience=4.0, step_time=Ema())
    keeper.step_time.observe(0.5)
    sts = states()
    assert keeper.realign(sts, 61) == 89  # 29 steps (14.5 s) behind a lead at its sync step 90: just before it
    assert (swarm.questions, [e["to_step"] for e in events.told]) == (1, [89])
    now[0] += CHECK_EVERY_S / 2
    assert keeper.realign(sts, 62) == 62 and swarm.questions == 1  # (not asked again so soon)
    assert keeper.realign(sts, 62, min_lag_seconds=0.0) == 89 and swarm.questions == 2  # told the lag: asked
    now[0] += CHECK_EVERY_S
    assert keeper.realign(sts, 63) == 89 and swarm.questions == 3
    swarm.step = 60  # (a sync step: taken as is)
    now[0] += CHECK_EVERY_S
    assert keeper.realign(sts, 63) == 63 and swarm.questions == 4  # in step: stays
