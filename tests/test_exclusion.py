"""Defences against hostile peers, alone: the offence ledger (peer/net/trust/exclusion.py), the member's scale check
of a reducer's result, and the records the consensus rules act on (Swarm.vouched_peers)."""

import torch

from peer.net.trust.span_checks import PLAUSIBLE, implausible
from peer.net.trust.exclusion import MAX_TRACKED, Exclusions, Offence, PeerVerdict


def test_a_peer_is_excluded_at_the_threshold_once_and_says_why():
    told = []
    ledger = Exclusions(threshold=3, on_exclude=lambda peer, why: told.append((peer, why)))
    assert not ledger.report("bad", Offence.CLIPPED, "fragment 0 round 1")
    assert not ledger.report("bad", Offence.BAD_PART, "fragment 1 round 1")
    assert "bad" not in ledger and ledger.offences("bad") == 2
    assert ledger.report("bad", Offence.BAD_AVERAGE, "fragment 0 round 2")
    assert "bad" in ledger and not ledger.report("bad", Offence.CLIPPED, "again")  # once
    assert len(told) == 1 and told[0][0] == "bad"
    assert "3 offences" in told[0][1] and "bad_average: fragment 0 round 2" in told[0][1]
    assert "other" not in ledger and ledger.excluded() == {"bad": told[0][1]}


def test_a_reducer_silent_in_rounds_in_a_row_is_excluded_one_silence_is_forgiven():
    """A reducer that holds its members to the deadline every round (never-finishing streams) is excluded after
    threshold rounds in a row; one that answers in between (a laptop that slept mid-round once) is not."""
    told = []
    ledger = Exclusions(threshold=3, on_exclude=lambda peer, why: told.append(peer))
    for r in range(5):
        assert not ledger.silent("sleepy", f"round {r}")
        assert not ledger.silent("sleepy", f"round {r}b")
        ledger.answered("sleepy")
    assert not ledger.silent("hang", "round 1") and not ledger.silent("hang", "round 2")
    assert ledger.silent("hang", "round 3") and "hang" in ledger and told == ["hang"]
    assert "sleepy" not in ledger and "3 rounds in a row" in ledger.excluded()["hang"]
    # the same through Verdicts, as a round returns them (Swarm.learn applies them)
    ledger.apply(PeerVerdict("slow", "round 1"))
    ledger.apply(PeerVerdict("slow", answered=True))
    ledger.apply(PeerVerdict("slow", "round 3"))
    ledger.apply(PeerVerdict("slow", "round 4"))
    assert "slow" not in ledger
    ledger.apply(PeerVerdict("slow", "round 5"))
    assert "slow" in ledger
    for r in range(3):
        ledger.apply(PeerVerdict("liar", f"round {r}: a negated average", Offence.BAD_AVERAGE))
    assert "liar" in ledger and "negated" in ledger.excluded()["liar"]


def test_offences_of_many_forged_ids_cost_bounded_memory():
    ledger = Exclusions(threshold=2)
    for i in range(MAX_TRACKED + 100):
        ledger.report(f"sybil{i}", Offence.BAD_PART, "x")
    assert ledger.offences("sybil0") == 0 and ledger.offences(f"sybil{MAX_TRACKED + 99}") == 1
    assert ledger.excluded() == {}


def test_a_scaled_average_is_implausible_an_honest_one_or_a_small_own_gradient_is_not():
    g = torch.Generator().manual_seed(0)
    ours = torch.randn(1000, generator=g)
    spans = [torch.randn(250, generator=g) for _ in range(4)]  # the round's results, one per reducer
    assert all(implausible(s, ours, spans) is None for s in spans)
    lie = 1000 * spans[3]
    assert implausible(lie, ours, spans[:3] + [lie]) is not None
    # we made few steps since the last round (a tiny outer gradient): the round's other results vouch for the scale
    assert implausible(spans[0], 1e-6 * ours, spans) is None
    assert implausible(2 * PLAUSIBLE * spans[0], ours, spans) is not None
    # two reducers, one lying: the lower median is the honest one
    assert implausible(lie, 1e-6 * ours, [spans[0], lie]) is not None


def test_forged_records_of_peers_that_never_took_part_do_not_move_a_running_peer(tmp_path):
    """Issue 13's forging variants against the consensus rules: made-up peer ids claiming a 'majority' state
    far ahead. A running peer acts only on the records of peers it was in a group with (Swarm.vouched_peers),
    so it neither skips its round as late nor downloads the forged state. A peer that met no one yet (a joiner)
    acts on the records of peers its daemon is connected to, one per host: ids no daemon answers for count for
    nothing, and the sybils of one host once. Sybils that sat in our groups count once per host as well."""
    from hivemind.utils import ValueWithExpiration

    from peer.config import SwarmConfig
    from peer.net.policy.consensus import launch_verdict, plan_catch_up
    from peer.net.trust.records import ProgressRecord
    from peer.net.swarm import Swarm

    def rec(pid, round_, digest):
        return ProgressRecord(peer_id=pid, step=100 * round_, round=round_, tokens_per_second=1.0, client_mode=False,
                              time=100.0, rounds=[round_], digests=[digest]).model_dump()

    honest = [c * 46 for c in "HJ"]
    sybils = [c * 46 for c in "STUV"]
    entries = {pid.encode(): ValueWithExpiration(rec(pid, 5, "aa"), 1e12) for pid in honest}
    entries.update({pid.encode(): ValueWithExpiration(rec(pid, 50, "ff"), 1e12) for pid in sybils})
    swarm = Swarm(SwarmConfig(new_swarm=True), run_key="t", codec="fp32", identity_path=str(tmp_path / "id"))
    swarm.roster.merge(ValueWithExpiration(entries, 1e12), dht_now=100.0, me="M" * 46)
    me = "M" * 46
    everyone = swarm.live_peers()
    assert set(everyone) == set(honest + sybils)
    assert plan_catch_up(everyone, me, [5], ["aa"], joining=False)[0].digest == "ff"  # what the forgery achieves
    assert launch_verdict(everyone, me, fragment=0, round_=6, expected_round=5, min_group_size=2) is not None
    assert swarm.vouched_peers() == {}  # a joiner whose daemon is connected to none of them: no anchor yet
    assert swarm.roster.meetable(everyone) == {}  # ... nor anyone a round waits for (Swarm.invited)
    swarm.hosts.learn([(honest[0], ["/ip4/10.0.0.1/tcp/1"]), (honest[1], ["/ip4/10.0.0.2/tcp/1"])]
                      + [(pid, ["/ip4/10.0.0.9/tcp/1"]) for pid in sybils[:2]])  # two sybils with a daemon each
    joiner = swarm.vouched_peers()
    assert set(joiner) == {*honest, sybils[0]}  # one per host; the sybils without a daemon not at all
    assert set(swarm.roster.meetable(everyone)) == {*honest, sybils[0]}
    assert plan_catch_up(joiner, me, [5], ["aa"], joining=True) == []
    assert launch_verdict(everyone, me, vouched=joiner, fragment=0, round_=6, expected_round=5,
                          min_group_size=2) is None
    swarm.roster.met(set(honest))  # we averaged with the two honest peers
    vouched = swarm.vouched_peers()
    assert set(vouched) == set(honest)
    assert plan_catch_up(vouched, me, [5], ["aa"], joining=False) == []
    assert launch_verdict(everyone, me, vouched=vouched, fragment=0, round_=6, expected_round=5,
                          min_group_size=2) is None
    # the sybils behave in one of our groups (partners now, a majority of ids), then claim round 50: one host, one
    # vote against the two honest hosts', so we neither skip our round as late nor download their state
    swarm.hosts.learn([(honest[0], ["/ip4/10.0.0.1/tcp/1"]), (honest[1], ["/ip4/10.0.0.2/tcp/1"])]
                      + [(pid, [f"/ip4/10.0.0.9/tcp/{i}"]) for i, pid in enumerate(sybils)])
    swarm.roster.met(set(sybils))
    assert set(swarm.live_peers()) == set(honest + sybils) and len(sybils) > len(honest)
    vouched = swarm.vouched_peers()
    assert set(vouched) == {*honest, sybils[0]}
    assert plan_catch_up(vouched, me, [5], ["aa"], joining=False) == []
    assert plan_catch_up(vouched, me, [5], ["aa"], joining=True) == []
    assert launch_verdict(everyone, me, vouched=vouched, fragment=0, round_=6, expected_round=5,
                          min_group_size=2) is None
    swarm._loop.close()  # (never started)
