"""The status line's words (peer/run/status.py): what a peer says it is doing."""

from peer.run.status import describe
from peer.net.view.activity import RoundActivity, RoundStage


def test_the_status_line_says_what_the_peer_waits_for():
    base = dict(now=100.0, live=3, need=2, activity=[], blocked=False, moved_ahead=None)
    assert describe(**base) == "training"
    patient = RoundActivity(0, 7, RoundStage.PATIENT, until=138.2, waiting_for=("QmB",))
    assert describe(**{**base, "activity": [patient]}) == \
        "waiting for 1 peer(s) behind by wall time to reach fragment 0 round 7 (up to 38 s)"
    assert describe(**{**base, "moved_ahead": 134}) == "out of phase with the swarm: moved ahead 134 steps to meet it"
    assert describe(**{**base, "live": 1}) == "alone: waiting for peers (1 visible, a group needs 2)"
    looking = RoundActivity(1, 3, RoundStage.MATCHMAKING, until=120.0)
    assert describe(**{**base, "activity": [looking]}) == "training"  # in flight while training (tau > 0)
    assert describe(**{**base, "activity": [looking], "blocked": True}) == \
        "waiting for peers (3 visible) in fragment 1 round 3 (up to 20 s)"
    averaging = RoundActivity(1, 3, RoundStage.ALLREDUCE, until=160.0)
    assert describe(**{**base, "activity": [averaging], "blocked": True}) == "averaging fragment 1 round 3"
