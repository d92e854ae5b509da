"""Whom a peer sees in the swarm (peer/net/view/roster.py): pure, no network."""

from __future__ import annotations

from hivemind.utils import ValueWithExpiration

from peer.net.flow.streams import HostBook
from peer.net.trust.exclusion import Exclusions, Offence
from peer.net.trust.records import ProgressRecord
from peer.net.view.roster import Roster

ME, A, B, C, D = ("M" * 46, "A" * 46, "B" * 46, "C" * 46, "D" * 46)


def entries(*recs: ProgressRecord):
    return ValueWithExpiration({r.peer_id.encode(): ValueWithExpiration(r.model_dump(), 1e12) for r in recs}, 1e12)


def rec(pid: str, paused: bool = False) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=1, round=0, tokens_per_second=1.0, client_mode=False, time=1.0,
                          paused=paused)


def test_live_peers_leave_out_the_excluded_the_unadmitted_and_the_paused_and_known_peers_are_remembered():
    exclusions = Exclusions(threshold=1)
    exclusions.report(C, Offence.BAD_PART, "a part that does not decode")
    roster = Roster(ttl=30.0, exclusions=exclusions, admitted=lambda pid: pid != D)
    roster.merge(entries(rec(ME), rec(A, paused=True), rec(B), rec(C), rec(D)), dht_now=100.0, me=ME)
    assert set(roster.live_peers()) == {ME, B}
    assert roster.paused_peers(ME) == [A]
    assert roster.known() == [B]
    roster.merge(None, dht_now=101.0, me=ME)  # a failed read forgets nothing
    assert set(roster.live_peers()) == {ME, B} and roster.known() == [B]
    # strangers until we were in a group with them; then their records are the ones the rules trust
    assert not roster.partnered(B) and set(roster.vouched_peers()) == {ME, B}
    roster.met({B})
    assert roster.partnered(B) and set(roster.vouched_peers()) == {B}


def test_arrivals_are_the_peers_that_came_into_view_partners_first_and_bounded():
    """Roster.merge returns whom the heartbeat greets: peers live now and not at the previous read (a joiner, or a
    peer whose record expired while its link was down and is back), our partners first, at most MAX_ARRIVALS (the
    rest in a random order: see the next test)."""
    from peer.net.view.roster import MAX_ARRIVALS

    now = [0.0]
    roster = Roster(ttl=10.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, clock=lambda: now[0])
    assert sorted(roster.merge(entries(rec(ME), rec(A), rec(B)), dht_now=100.0, me=ME)) == [A, B]
    roster.met({B})
    assert roster.merge(entries(rec(ME), rec(A), rec(B)), dht_now=101.0, me=ME) == []  # still in view: no one
    now[0] = 30.0  # both records expired (their links were down): out of view
    assert roster.merge(None, dht_now=130.0, me=ME) == [] and not roster.live_peers()
    back = [ProgressRecord(**{**rec(p).model_dump(), "time": 2.0}) for p in (A, B)]
    assert roster.merge(entries(*back), dht_now=131.0, me=ME) == [B, A]  # back: B, our partner, first
    # a host minting identities: MAX_ARRIVALS a read, and the partner still first
    sybils = ["S" * 45 + c for c in "123456789ABCDEFGHJKLMNPQRSTUVWXYZ"[:3 * MAX_ARRIVALS]]
    now[0] = 60.0
    roster.merge(None, dht_now=160.0, me=ME)
    got = roster.merge(entries(*[ProgressRecord(**{**rec(p).model_dump(), "time": 3.0}) for p in (B, *sybils)]),
                       dht_now=161.0, me=ME)
    assert len(got) == MAX_ARRIVALS and got[0] == B


def test_arrivals_left_over_by_a_crowd_of_identities_come_at_the_next_reads():
    """A host that mints identities puts far more than MAX_ARRIVALS records in view at once, wherever they sort:
    each read hands out MAX_ARRIVALS more of those still live, each once, so an honest joiner among them is greeted
    within a few beats (in a random order: on average half-way)."""
    from peer.net.view.roster import MAX_ARRIVALS

    sybils = [f"S{i:045d}".replace("0", "z") for i in range(5 * MAX_ARRIVALS)]  # (base58: no 0)
    honest = "H" * 46
    firsts = []
    for trial in range(20):
        roster = Roster(ttl=10.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True)
        view = [rec(p) for p in (ME, *sybils, honest)]  # the joiner's record last
        handed: list[str] = []
        for beat in range(6):
            got = roster.merge(entries(*view), dht_now=100.0 + beat, me=ME)
            assert len(got) == (MAX_ARRIVALS if beat < 5 else 1) and not set(got) & set(handed)
            handed += got
        assert sorted(handed) == sorted([*sybils, honest]), trial
        assert roster.merge(entries(*view), dht_now=107.0, me=ME) == []  # everyone greeted: no one left
        firsts.append(handed.index(honest) // MAX_ARRIVALS)
    assert min(firsts) < 5  # not always last, as the records' order would have it (fails ~1 time in 10^14)



def test_before_any_group_only_connected_peers_anchor_one_per_host_and_ours():
    """A peer that met no one yet acts on the records of peers its daemon holds a connection with (the host book's
    listing), one per host (the smallest id), loopback and relayed peers one by one, and on its own; once it was
    in a group, on its partners'."""
    E, F = "E" * 46, "F" * 46
    hosts = HostBook()
    roster = Roster(ttl=30.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, hosts=hosts)
    roster.merge(entries(*(rec(p) for p in (ME, A, B, C, D, E, F))), dht_now=100.0, me=ME)
    assert set(roster.vouched_peers()) == {ME}  # nobody listed yet: none of their records anchors
    hosts.learn([(A, ["/ip4/198.51.100.1/tcp/1"]), (B, ["/ip4/203.0.113.7/tcp/1"]), (C, ["/ip4/203.0.113.7/tcp/2"]),
                 (D, ["/ip4/127.0.0.1/tcp/3"]), (E, ["/ip4/127.0.0.1/tcp/4"])])  # (F: no daemon answers for it)
    assert set(roster.vouched_peers()) == {ME, A, B, D, E}
    roster.met({C})
    assert set(roster.vouched_peers()) == {C}
    # whom a round may wait for: partners, and the anchored others (F, whose id no daemon answers for, never)
    assert set(roster.meetable(roster.live_peers())) == {ME, A, B, C, D, E}


def test_partners_vote_once_per_host_and_keep_the_host_they_were_met_from():
    """Sybil ids that sat in our groups are partners; their records still count once per host (the smallest id),
    loopback and relayed partners one by one. A partner that closed its connection keeps the host it was met
    from; partners never resolved share one vote."""
    S1, S2, S3, E = "S" * 46, "T" * 46, "U" * 46, "E" * 46
    hosts = HostBook()
    roster = Roster(ttl=30.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, hosts=hosts)
    roster.merge(entries(*(rec(p) for p in (ME, A, B, C, D, E, S1, S2, S3))), dht_now=100.0, me=ME)
    attacker = "/ip4/203.0.113.66/tcp/"
    hosts.learn([(A, ["/ip4/198.51.100.1/tcp/1"]), (B, ["/ip4/127.0.0.1/tcp/2"]), (C, ["/ip4/127.0.0.1/tcp/3"]),
                 (S1, [attacker + "1"]), (S2, [attacker + "2"]), (S3, [attacker + "3"])])
    roster.met({A, B, C, S1, S2, S3})
    assert set(roster.vouched_peers()) == {A, B, C, S1}  # three sybil partners: one vote
    hosts.learn([(A, ["/ip4/198.51.100.1/tcp/1"]), (B, ["/ip4/127.0.0.1/tcp/2"]), (C, ["/ip4/127.0.0.1/tcp/3"])])
    assert set(roster.vouched_peers()) == {A, B, C, S1}  # connections closed: the hosts they were met from
    roster.met({D, E})  # (never listed by the daemon: one vote for both)
    assert set(roster.vouched_peers()) == {A, B, C, S1, D}
    hosts.learn([(D, ["/ip4/198.51.100.4/tcp/1"]), (E, ["/ip4/198.51.100.5/tcp/1"])])
    roster.merge(None, dht_now=101.0, me=ME)  # the heartbeat's next read remembers what the listing resolved
    hosts.learn([])
    assert set(roster.vouched_peers()) == {A, B, C, S1, D, E}


def test_a_peer_that_does_not_hold_the_state_it_advertised_is_no_vote_for_a_records_lifetime():
    """A partner asked for the state its record advertised says it holds none (bench/swarm_attacks.py far_ahead: a
    record claiming round 1000, tied with the one honest partner's, kept every round ``behind`` and every catch-up
    failing, 0 of 76 rounds applied): its records are no vote for ``ttl`` seconds, then count again. Before any
    group, the same holds of the peers our daemon anchors."""
    now = [100.0]
    roster = Roster(ttl=30.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, clock=lambda: now[0])
    roster.merge(entries(*(rec(p) for p in (ME, A, B, C))), dht_now=100.0, me=ME)
    assert set(roster.vouched_peers()) == {ME, A, B, C}  # (no group yet, no host book: every record anchors)
    roster.unheld(C)
    assert set(roster.vouched_peers()) == {ME, A, B}
    roster.met({A, C})
    assert set(roster.vouched_peers()) == {A}
    assert C in roster.live_peers()  # (still live: a group target, a member; only its word moves nothing)
    now[0] += 31.0
    fresh = [rec(p).model_copy(update={"time": 2.0}) for p in (ME, A, B, C)]  # (the next heartbeat's records)
    roster.merge(entries(*fresh), dht_now=131.0, me=ME)
    assert set(roster.vouched_peers()) == {A, C}


def test_a_partner_that_moved_past_the_state_we_asked_for_votes_again_once_another_vote_holds_its_new_state():
    """In a swarm whose rounds come faster than its heartbeats, every partner asked for the state its last record
    advertised may have moved past it and say "no such state". Muting them all for the records' ttl kept a rejoined
    peer's round searching 9 s for a group the others had applied before it started (docs/benchmarks.md,
    2026-11-30). A partner votes again once its record shows a later state of that fragment that another vote holds
    too. A record that moves on to a state no other vote holds (far_ahead's next claim) stays no vote, and so does a
    donor that failed to deliver anything (no state named)."""
    now = [100.0]
    roster = Roster(ttl=30.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, clock=lambda: now[0])

    def at(pid: str, round_: int, digest: str, t: float) -> ProgressRecord:  # (fragment 0's state; fragment 1's fixed)
        return ProgressRecord(**{**rec(pid).model_dump(), "rounds": [round_, 1], "digests": [digest, "7b" * 6],
                                 "time": t})

    roster.merge(entries(at(ME, 17, "0a" * 6, 1.0), *(at(p, 16, "1b" * 6, 1.0) for p in (A, B, C)),
                         at(D, 1000, "4e" * 6, 1.0)), dht_now=100.0, me=ME)
    roster.met({A, B, C, D})
    assert set(roster.vouched_peers()) == {A, B, C, D}
    for pid in (A, B, C):
        roster.unheld(pid, (0, 16))
    roster.unheld(D, (0, 1000))
    assert set(roster.vouched_peers()) == {ME}  # (no partner votes: ours alone, no one past our state)
    now[0] += 2.0  # the next read: A and B applied rounds 17 to 19 alike, C one more, D claims one more too
    roster.merge(entries(at(ME, 17, "0a" * 6, 2.0), at(A, 19, "2c" * 6, 2.0), at(B, 19, "2c" * 6, 2.0),
                         at(C, 20, "3d" * 6, 2.0), at(D, 1001, "5f" * 6, 2.0)), dht_now=102.0, me=ME)
    assert set(roster.vouched_peers()) == {A, B}
    roster.merge(entries(at(C, 19, "2c" * 6, 3.0)), dht_now=103.0, me=ME)  # (C's record, read again at round 19)
    assert set(roster.vouched_peers()) == {A, B, C}
    roster.unheld(B)  # (three failed downloads: no state named)
    assert set(roster.vouched_peers()) == {A, C}
    now[0] += 31.0  # the marks' ttl
    fresh = [at(p, 25, "6a" * 6, 4.0) for p in (ME, A, B, C, D)]
    roster.merge(entries(*fresh), dht_now=134.0, me=ME)
    assert set(roster.vouched_peers()) == {A, B, C, D}


def test_a_donor_that_fails_three_downloads_in_a_row_is_no_vote_for_a_records_lifetime():
    """A donor whose record advertises a state it never delivers (busy at every ask, an error answer, a cut stream)
    kept every catch-up failing as one that says it holds none did: its third failure in a row makes it unheld. A
    part it delivers in between starts the count again (an honest donor is busy now and then)."""
    from peer.net.view.roster import MAX_DONOR_FAILURES

    roster = Roster(ttl=30.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, clock=lambda: 100.0)
    roster.merge(entries(*(rec(p) for p in (ME, A, B))), dht_now=100.0, me=ME)
    for _ in range(MAX_DONOR_FAILURES - 1):
        roster.donor_failed(B)
    roster.donor_served(B)
    for _ in range(MAX_DONOR_FAILURES - 1):
        roster.donor_failed(B)
    assert set(roster.vouched_peers()) == {ME, A, B}
    roster.donor_failed(B)
    assert set(roster.vouched_peers()) == {ME, A}


def test_a_peers_key_is_the_one_its_record_is_signed_with_if_its_id_is_that_keys_hash():
    """(The key a member's claims are checked against when we hold none of its claims: peer/net/witness.py.)"""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net.trust.auth import peer_id_of

    key = RSAPrivateKey().get_public_key()
    pid, other = peer_id_of(key), peer_id_of(RSAPrivateKey().get_public_key())
    subkey = b"[owner:" + key.to_bytes() + b"]"
    roster = Roster(ttl=30.0, exclusions=Exclusions(), admitted=lambda p: True)
    roster.merge(ValueWithExpiration({subkey: ValueWithExpiration(rec(pid).model_dump(), 1e12),
                                      b"[owner:" + key.to_bytes() + b"]x": ValueWithExpiration(rec(other).model_dump(),
                                                                                               1e12)}, 1e12),
                 dht_now=100.0, me=ME)
    assert roster.key_of(pid) is not None and roster.key_of(pid).to_bytes() == key.to_bytes()
    assert roster.key_of(other) is None  # (a record its signer's key does not certify: not its key)
    assert roster.key_of(A) is None
