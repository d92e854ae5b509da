"""What the records say a peer should do (peer/net/policy/consensus.py), alone: catching up, launching or not, and the
phase rules of the steps schedule (patience, giving up, realignment)."""

from __future__ import annotations

from peer.net.policy.consensus import (in_step_with, laggards, launch_gate, launch_verdict, nobody_coming,
plan_catch_up,
                                projected_step, realign, step_after_catch_up, swarm_is_past, swarm_state)
from peer.net.trust.records import ProgressRecord
from peer.outer.rounds import RoundStatus
from peer.outer.schedule import last_sync_step, next_sync_step, sync_step

H, P = 20, 2  # fragment 0 syncs after steps 20, 40, ...; fragment 1 (offset 10) after 30, 50, ...


def rec(pid: str, step: int, rounds=(3, 3), seeking=(), time: float = 100.0) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=step, round=rounds[0], rounds=list(rounds), digests=["d"] * len(rounds),
                          seeking=[list(s) for s in seeking], tokens_per_second=1.0, client_mode=False, time=time)


def view(*records: ProgressRecord) -> dict:
    return {r.peer_id: r for r in records}


def test_schedule_helpers():
    assert [sync_step(0, r, P, H) for r in (1, 2)] == [20, 40] and sync_step(1, 1, P, H) == 30
    assert last_sync_step(0, P, H) == 0 and last_sync_step(29, P, H) == 20 and last_sync_step(30, P, H) == 30
    assert next_sync_step(30, P, H) == 40 and next_sync_step(31, P, H) == 40


def test_laggards_are_the_live_peers_that_have_not_reached_the_launch_step():
    records = view(rec("me", 40), rec("a", 39), rec("b", 40), rec("c", 55), rec("d", 2))
    assert laggards(records, "me", 40) == ["a", "d"]
    assert laggards(view(rec("me", 40)), "me", 40) == []


def test_nobody_coming_when_every_other_peer_left_the_round_without_it():
    # round 2 of fragment 0 was launched at step 40
    gone = view(rec("me", 40, rounds=(1, 1)), rec("a", 47, rounds=(1, 1)), rec("b", 61, rounds=(1, 1)))
    assert "left this round" in nobody_coming(gone, "me", launch_step=40, fragment=0, round_=2)
    still_in_it = view(rec("a", 47, rounds=(1, 1), seeking=[(0, 2)]), rec("b", 61, rounds=(1, 1)))
    assert nobody_coming(still_in_it, "me", launch_step=40, fragment=0, round_=2) is None  # tau > 0: a seeks it
    # a and b averaging in that round: their group may include us while the leader's word is still on its way
    # (seen in the netns lab: a 3 Mbit/s peer gave up on a group that had formed with it, and its spans were lost)
    averaging = view(*(r.model_copy(update={"averaging": [[0, 2]]}) for r in (rec("a", 47, rounds=(1, 1)),
                                                                              rec("b", 61, rounds=(1, 1)))))
    assert nobody_coming(averaging, "me", launch_step=40, fragment=0, round_=2) is None
    at_launch = view(rec("a", 40, rounds=(1, 1)), rec("b", 61, rounds=(1, 1)))
    assert nobody_coming(at_launch, "me", launch_step=40, fragment=0, round_=2) is None  # a is at it (blocked)
    applied = view(rec("a", 47, rounds=(2, 1)))
    assert nobody_coming(applied, "me", launch_step=40, fragment=0, round_=2) is None  # late: state_transfer's rule
    assert nobody_coming(view(rec("me", 40)), "me", launch_step=40, fragment=0, round_=2) is None  # alone: no


def test_projected_step():
    kw = dict(now=102.0, H=H, num_fragments=P)
    assert projected_step(rec("a", 41, time=100.0), step_seconds=0.5, **kw) == 45  # 2 s at 0.5 s per step
    assert projected_step(rec("a", 41, time=100.0), step_seconds=0.1, **kw) == 50  # not past its next sync
    assert projected_step(rec("a", 40, time=90.0), step_seconds=0.1, **kw) == 40  # at a sync: maybe blocked
    assert projected_step(rec("a", 41, time=100.0), step_seconds=None, **kw) == 41  # our speed unknown
    assert projected_step(rec("a", 55, seeking=[(1, 2), (0, 2)]), step_seconds=0.1, **kw) == 40  # the earliest
    assert projected_step(rec("a", 55, seeking=[(0, 99)]), step_seconds=0.1, **kw) == 55  # never past its step


def test_in_step_with():
    assert in_step_with(rec("a", 0, rounds=(3, 2)), [3, 3])  # one round late: same phase
    assert not in_step_with(rec("a", 0, rounds=(1, 3)), [3, 3])  # trained alone: it will move back itself
    assert not in_step_with(rec("a", 0, rounds=(3,)), [3, 3])
    assert in_step_with(rec("a", 0, rounds=(4, 3)), [3, 3]) and not in_step_with(rec("a", 0, rounds=(5, 3)), [3, 3])


def test_realign_moves_up_to_just_before_the_round_the_lead_is_at():
    kw = dict(my_rounds=[3, 3], step_seconds=0.1, min_lag_seconds=30.0, H=H, num_fragments=P, now=100.0)
    records = view(rec("me", 12), rec("lead", 95, time=100.0), rec("slow", 60, time=100.0))
    move = realign(records, "me", my_step=12, **kw)
    assert (move.step, move.lead, move.behind_steps) == (89, "lead", 83)  # launches fragment 1 at 90 next
    seeking = view(rec("lead", 95, seeking=[(0, 4)], time=100.0))  # blocked at 80, looking for a group
    assert realign(seeking, "me", my_step=12, **kw).step == 79
    assert realign(records, "me", my_step=88, **kw) is None  # 7 steps (0.7 s) behind: patience covers it
    far_in_time = dict(kw, step_seconds=5.0)  # 7 steps at 5 s each: 35 s, more than patience would wait
    assert realign(records, "me", my_step=81, **far_in_time).step == 89
    assert realign(records, "me", my_step=120, **kw) is None  # never back
    stale = view(rec("alone", 400, rounds=(1, 3), time=100.0))  # ran on alone with an old state: not followed
    assert realign(stale, "me", my_step=12, **kw) is None
    unmeasured = dict(kw, step_seconds=None)  # right after a restart: a whole H behind is enough
    assert realign(records, "me", my_step=12, **unmeasured).step == 89
    assert realign(view(rec("me", 12)), "me", my_step=12, **kw) is None
    # issue 13: one record claiming to be far ahead (in steps, or in rounds too) sets no phase among others
    honest = [rec("h1", 95, time=100.0), rec("h2", 93, time=100.0)]
    for forged in (rec("liar", 10**6), rec("liar", 10**6, rounds=(1003, 1003)), rec("liar", 200)):
        assert realign(view(rec("me", 12), *honest, forged), "me", my_step=12, **kw).step == 89, forged
    assert realign(view(rec("me", 12), rec("liar", 10**6, rounds=(1003, 1003))), "me", my_step=12, **kw) is None
    # alone with one other peer that trained on alone while we were away (its step past its rounds): followed
    assert realign(view(rec("me", 12), rec("other", 400)), "me", my_step=12, **kw).step == 399


def state(pid, rounds, digests):
    return ProgressRecord(peer_id=pid, step=0, round=rounds[0], tokens_per_second=0.0, client_mode=False, time=0.0,
                          rounds=rounds, digests=digests)


def test_joiner_downloads_every_fragment_where_it_is_behind():
    records = {p: state(p, [7, 6], ["a", "b"]) for p in ("x", "y")}
    records["z"] = state("z", [7, 5], ["c", "q"])  # one peer disagrees at round 7: the majority wins
    plans = plan_catch_up(records, "me", [0, 0], ["init", "init"], joining=True)
    assert [(c.fragment, c.round, c.digest, sorted(c.donors)) for c in plans] == [
        (0, 7, "a", ["x", "y"]), (1, 6, "b", ["x", "y"])]


def test_running_peer_tolerates_one_round_of_lag_but_not_two_or_a_minority_digest():
    records = {p: state(p, [5], ["a"]) for p in ("x", "y")}
    assert plan_catch_up(records, "me", [4], ["old"], joining=False) == []  # about to apply round 5 itself
    assert plan_catch_up(records, "me", [3], ["old"], joining=False)[0].round == 5
    drifted = plan_catch_up(records, "me", [5], ["mine"], joining=False)
    assert drifted and drifted[0].digest == "a" and "disagrees" in drifted[0].reason
    assert plan_catch_up(records, "me", [5], ["a"], joining=False) == []


def test_two_survivors_that_diverged_converge_on_the_smaller_digest():
    assert plan_catch_up({"x": state("x", [5], ["a"])}, "me", [5], ["b"], joining=False)[0].digest == "a"
    assert plan_catch_up({"x": state("x", [5], ["b"])}, "me", [5], ["a"], joining=False) == []  # we keep ours
    three_way = {"x": state("x", [5], ["c"]), "y": state("y", [5], ["a"])}
    assert plan_catch_up(three_way, "me", [5], ["b"], joining=False)[0].digest == "a"
    assert plan_catch_up({"me": state("me", [9], ["z"])}, "me", [0], ["i"], joining=True) == []  # ourselves


def test_a_tie_is_not_decided_while_another_record_lags_behind_our_round():
    # Seen in a 4-peer swarm: a rejoined peer ended round 19 partial (digest "a"); the three others ended it ok
    # ("b"). Each of them saw the rejoined peer's record at round 19 and the other two's still at 18: a 1-1 tie
    # that "a" won, so all three adopted the minority state. A lagging record leaves the tie open ...
    stale = {"p4": state("p4", [19], ["a"]), "p1": state("p1", [18], ["z"]), "p2": state("p2", [18], ["z"])}
    assert plan_catch_up(stale, "me", [19], ["b"], joining=False) == []
    # ... until every record is at our round (or past it), when the smaller digest wins as before
    settled = {"p4": state("p4", [19], ["a"]), "p1": state("p1", [20], ["y"])}
    assert plan_catch_up(settled, "me", [19], ["b"], joining=False)[0].digest == "a"
    # the peer with the partial result follows the majority at once, lagging records or not
    majority = {"p1": state("p1", [19], ["b"]), "p2": state("p2", [19], ["b"]), "p3": state("p3", [18], ["z"])}
    assert plan_catch_up(majority, "p4", [19], ["a"], joining=False)[0].digest == "b"
    # ... and, knowing its last round of the fragment was partial (suspect), the one record already at its
    # round is enough, whichever digest is smaller (seen: the cut peer's digest stayed off for 6 rounds while
    # the drift check waited for a second record or a smaller digest)
    one = {"p1": state("p1", [19], ["b"]), "p2": state("p2", [18], ["z"])}
    assert plan_catch_up(one, "p4", [19], ["c"], joining=False) == []
    assert plan_catch_up(one, "p4", [19], ["c"], joining=False, suspect=[0])[0].digest == "b"
    assert plan_catch_up(one, "p4", [19], ["a"], joining=False, suspect=[0])[0].digest == "b"


def test_the_drift_check_compares_at_our_round_through_records_already_past_it():
    """Rounds faster than records (seen: rounds 0.5 s apart, records every 1 s, a check every 3 s): a record is
    rarely at exactly our round, so two survivors of a broken round stayed apart to the end of the run. A record
    lists its last few rounds in ``past``: a peer a round past ours still tells its digest at our round, and we
    download where it is now."""
    ahead = state("p1", [20], ["d20"]).model_copy(update={"past": [(0, 18, "d18"), (0, 19, "b")]})
    plan = plan_catch_up({"p1": ahead}, "p4", [19], ["c"], joining=False, suspect=[0])
    assert [(c.fragment, c.round, c.digest, c.donors) for c in plan] == [(0, 20, "d20", ["p1"])]
    assert plan_catch_up({"p1": ahead}, "p4", [19], ["b"], joining=False, suspect=[0]) == []  # we agree at 19
    silent = state("p1", [20], ["d20"])  # no past: it does not say where it was at 19 (one round ahead: no plan)
    assert plan_catch_up({"p1": silent}, "p4", [19], ["c"], joining=False, suspect=[0]) == []


def test_at_a_round_our_group_applied_only_its_appliers_can_say_our_state_is_off():
    """Records of peers that did not apply our round with us (sybils that sat in one group and became partners, or
    strangers) cannot pull us off the digest our group applied, however many they are; our co-appliers' can."""
    sybils = {p: state(p, [5], ["forged"]) for p in ("s1", "s2", "s3")}
    assert plan_catch_up(sybils, "me", [5], ["ours"], joining=False)[0].digest == "forged"  # (no group known)
    group = {5: {"g1", "g2"}}
    assert plan_catch_up({**sybils, "g1": state("g1", [5], ["ours"])}, "me", [5], ["ours"], joining=False,
                         confirmed=[group]) == []
    assert plan_catch_up(sybils, "me", [5], ["ours"], joining=False, confirmed=[group]) == []  # (g1, g2 gone)
    off = {**sybils, "g1": state("g1", [5], ["theirs"]), "g2": state("g2", [5], ["theirs"])}
    plan = plan_catch_up(off, "me", [5], ["ours"], joining=False, confirmed=[group])
    assert [(c.round, c.digest, sorted(c.donors)) for c in plan] == [(5, "theirs", ["g1", "g2"])]
    # a round we did not apply in a group (adopted, or an older state): the rule of the records as before
    assert plan_catch_up(sybils, "me", [5], ["ours"], joining=False, confirmed=[{4: {"g1"}}])[0].digest == "forged"
    # whether we are behind is still the records' word (it decides launches too: launch_gate)
    far = {p: state(p, [8], ["forged"]) for p in ("s1", "s2")}
    assert plan_catch_up(far, "me", [5], ["ours"], joining=False, confirmed=[group])[0].round == 8


def test_one_partner_far_ahead_does_not_outvote_an_honest_partner_that_holds_our_state():
    """bench/swarm_attacks.py far_ahead: a stranger sat in our first group (a partner now, one host, one vote), then
    claims round 1001 of a state it serves under that state's own digest. Our other partner holds our state: with
    ours counted that is two holders against one, so nothing is late, nothing behind, nothing downloaded. Without
    ours it was a tie that the later round won (the forged state adopted)."""
    records = {"honest": state("honest", [1], ["d1"]), "far": state("far", [1001], ["forged"])}
    mine = (1, "d1")
    assert swarm_state(records, "me", 0) == (1001, "forged", ["far"])  # (the tie the attack won)
    assert swarm_state(records, "me", 0, mine) == (1, "d1", ["honest"])
    assert plan_catch_up(records, "me", [1], ["d1"], joining=False) == []
    assert plan_catch_up(records, "me", [1], ["d1"], joining=False, late=True) == []
    assert launch_gate(records, "me", 0, 2, my_expected=1, mine=mine) is None
    assert launch_gate(records, "me", 0, 2, my_expected=1).startswith("late")  # (without ours)
    assert launch_verdict(records, "me", fragment=0, round_=2, expected_round=1, min_group_size=2, mine=mine) is None
    # the honest partner applied a round we missed: a three-way tie, the later round (one host against one)
    moved = {**records, "honest": state("honest", [2], ["d2"])}
    assert swarm_state(moved, "me", 0, mine)[:2] == (1001, "forged")
    # the state most peers hold wins as before, ours counted like any other: ahead, behind, or a joiner's
    assert swarm_state({"x": state("x", [7], ["a"]), "y": state("y", [7], ["a"])}, "me", 0, (3, "old"))[:2] == (7, "a")
    assert swarm_state({"x": state("x", [7], ["a"])}, "me", 0, (3, "old"))[:2] == (7, "a")  # a tie: the later
    assert swarm_state({"x": state("x", [3], ["b"])}, "me", 0, (3, "a"))[:2] == (3, "a")  # ...then the smaller


def test_a_tie_goes_to_the_state_more_live_records_hold_then_to_the_later_round():
    """bench/swarm_attacks.py served_ahead, authenticated: before its first group a peer's votes are its own and the
    records of the peers its daemon lists a connection with. The attacker was the only one listed yet: its round 1000
    tied our initial state, the later round won, and the peer downloaded the forged state and jumped to its step.
    The three honest records holding our state were live: a tie now goes to what more live records hold."""
    vouched = {"x": state("x", [1000], ["forged"])}
    live = {**vouched, **{p: state(p, [0], ["init"]) for p in ("h0", "h1", "h2")}}
    mine = (0, "init")
    assert swarm_state(vouched, "me", 0, mine) == (1000, "forged", ["x"])  # (what the attack won)
    assert swarm_state(vouched, "me", 0, mine, support=live)[:2] == (0, "init")
    assert plan_catch_up(vouched, "me", [0], ["init"], joining=True, support=live) == []
    assert launch_verdict(live, "me", vouched=vouched, fragment=0, round_=1, expected_round=0, min_group_size=2,
                          mine=mine) is None  # (launch_verdict's live records are the support)
    assert swarm_is_past(vouched, "me", 0, 1, mine=mine, support=live) is None  # (a round's search goes on)
    # the honest peers are still building their models: their records advertise no state yet, and back ours
    starting = {**vouched, **{p: ProgressRecord(peer_id=p, step=0, round=0, tokens_per_second=0.0, client_mode=False,
                                                time=0.0) for p in ("h0", "h1", "h2")}}
    assert swarm_state(vouched, "me", 0, mine, support=starting)[:2] == (0, "init")
    assert plan_catch_up(vouched, "me", [0], ["init"], joining=True, support=starting) == []
    # a joiner of a two-peer swarm still takes the other peer's state: as many live records hold each
    alone = {"p": state("p", [50], ["d50"])}
    assert plan_catch_up(alone, "me", [0], ["init"], joining=True, support=alone)[0].round == 50
    assert launch_gate(alone, "me", 0, 1, my_expected=0, mine=mine, support=alone).startswith("late")
    # support breaks ties only: two vouched holders outvote one, however many live records back the one
    two = {"p": state("p", [50], ["d50"]), "q": state("q", [50], ["d50"])}
    assert swarm_state(two, "me", 0, mine, support={**two, **live})[:2] == (50, "d50")
    # the honest partner applied a round we missed and a far-ahead partner ties it: the others' records decide
    partners = {"honest": state("honest", [2], ["d2"]), "far": state("far", [1001], ["forged"])}
    others = {**partners, "h1": state("h1", [2], ["d2"])}
    assert swarm_state(partners, "me", 0, (1, "d1"), support=others)[:2] == (2, "d2")


def test_launch_gate_skips_rounds_the_swarm_is_past():
    records = {p: state(p, [7, 6], ["a", "b"]) for p in ("x", "y")}
    # in step with the swarm (it applied round 7; we applied 7, or have it in flight): launch round 8
    assert launch_gate(records, "me", 0, 8, my_expected=7) is None
    # late: the swarm already applied the round we are about to launch, no one will come
    assert launch_gate(records, "me", 0, 7, my_expected=6).startswith("late")
    # one round behind (we missed round 7): join the swarm's current round, the drift check repairs us
    assert launch_gate(records, "me", 0, 8, my_expected=6) is None
    # behind: our round counter ran on alone during an outage, our state is many rounds old
    assert launch_gate(records, "me", 0, 8, my_expected=5).startswith("behind")
    assert launch_gate(records, "me", 1, 46, my_expected=2).startswith("behind")
    assert launch_gate({}, "me", 0, 3, my_expected=0) is None  # no one else: nothing to be behind of
    # the repair, once a round was late: every fragment the swarm is past, counting our rounds in flight
    # (fragment 1: applied 5, round 6 in flight, swarm at 6: nothing to download); a drift check tolerates one
    assert plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False) == []
    plans = plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False, expected=[6, 6], late=True)
    assert [(c.fragment, c.round, c.digest) for c in plans] == [(0, 7, "a")]
    plans = plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False, expected=[6, 5], late=True)
    assert [(c.fragment, c.round, c.digest) for c in plans] == [(0, 7, "a"), (1, 6, "b")]


def test_launch_verdict_is_the_one_place_that_keeps_a_round_home():
    records = {p: state(p, [7, 6], ["a", "b"]) for p in ("x", "y")}
    assert launch_verdict(records, "me", fragment=0, round_=8, expected_round=7, min_group_size=2) is None
    status, why = launch_verdict(records, "me", fragment=0, round_=7, expected_round=6, min_group_size=2)
    assert status == RoundStatus.BEHIND and why.startswith("late") and not status.launched
    status, why = launch_verdict({}, "me", fragment=0, round_=3, expected_round=0, min_group_size=2)
    assert (status, why) == (RoundStatus.ALONE, "1 live peer(s) < min_group_size 2")
    status, _ = launch_verdict(records, "me", fragment=0, round_=8, expected_round=7, min_group_size=4)
    assert status == RoundStatus.ALONE  # 3 live < 4


def test_after_a_download_the_step_moves_up_to_the_donors_and_back_only_after_running_ahead_alone():
    records = {"x": rec("x", 95), "me": rec("me", 60)}
    assert step_after_catch_up(60, [], records, "me", H) == 60  # nothing downloaded
    assert step_after_catch_up(60, [80, 90], records, "me", H) == 90  # behind the donors: up to them
    assert step_after_catch_up(100, [90], records, "me", H) == 100  # a bit ahead: never back (re-launching)
    assert step_after_catch_up(400, [90], records, "me", H) == 90  # ran ahead alone (> H past everyone): back


def test_drift_is_found_at_our_latest_round_the_records_cover_and_repaired_at_our_round():
    """Rounds faster than records: no other record has reached our round 12 yet. The check compares at our round
    11 (their current one), where our state already went off (a catch-up that landed a round late), and finds the
    drift; with our round 11 right, nothing is found; without our history nothing can be judged. The download
    waits until the holders' records show our round 12: adopting their round 11 would put us a round behind, and
    our next round would apply the swarm's average to that old state, off again, and so round after round while
    the swarm's rounds come faster than its records (a peer resumed in a swarm with a round every second)."""
    others = {p: state(p, [11], ["good11"]) for p in ("x", "y")}
    plans = plan_catch_up(others, "me", [12], ["ours12"], joining=False, my_past=[{10: "a", 11: "bad11"}])
    assert [(c.fragment, c.round, c.digest, sorted(c.donors), c.wait) for c in plans] == [
        (0, 11, "good11", ["x", "y"], True)]
    assert "at round 11" in plans[0].reason
    assert plan_catch_up(others, "me", [12], ["ours12"], joining=False, my_past=[{11: "good11"}]) == []
    assert plan_catch_up(others, "me", [12], ["ours12"], joining=False) == []
    # a heartbeat later the records tell where the holders are now, our round 12: that state is downloaded
    moved = {p: state(p, [12], ["good12"]).model_copy(update={"past": [(0, 11, "good11")]}) for p in ("x", "y")}
    plans = plan_catch_up(moved, "me", [12], ["ours12"], joining=False, my_past=[{10: "a", 11: "bad11"}])
    assert [(c.round, c.digest, c.wait) for c in plans] == [(12, "good12", False)]
    # our round 13 in flight (tau > 0): adopting 12 would drop it while the swarm applies it, so it waits too
    plans = plan_catch_up(moved, "me", [12], ["ours12"], joining=False, expected=[13], my_past=[{11: "bad11"}])
    assert [(c.round, c.wait) for c in plans] == [(12, True)]


def test_a_peer_in_client_mode_counts_for_the_swarms_state_but_is_no_donor():
    """Behind a NAT (client mode) nobody can dial a peer: its state still counts in the majority, but a
    download never goes to it; when only such peers hold the state there is no donor to ask."""
    natted = rec("nat", 100, rounds=(5, 5)).model_copy(update={"client_mode": True})
    records = view(rec("me", 60), rec("a", 100, rounds=(5, 5)), natted)
    plans = plan_catch_up(records, "me", [3, 3], ["d", "d"], joining=True)
    assert [p.round for p in plans] == [5, 5]
    assert all(p.donors == ["a"] for p in plans)
    assert swarm_state(view(rec("me", 60), natted), "me", 0) == (5, "d", [])


def test_a_donors_step_is_believed_only_as_far_as_the_schedule_allows():
    """Its donor applied round r of fragment p at most H steps after the round's sync step (H = 20, 2 fragments:
    fragment 1 syncs at 10 + 20 r)."""
    from peer.net.policy.consensus import plausible_donor_step

    assert plausible_donor_step(95, 1, 4, 2, 20) == 95  # launched at 90, applied 5 steps later
    assert plausible_donor_step(10**9, 1, 4, 2, 20) == 110  # a claim past the round's window
    assert plausible_donor_step(-5, 0, 0, 2, 20) == 0
