"""Whom a round waits for (peer/net/view/attendance.py): pure, no network."""

from __future__ import annotations

from peer.net.view.attendance import MAX_TRACKED, STRANGERS, Attendance, catching_up, early_assembly
from peer.net.trust.records import ProgressRecord

ME = "M" * 46


def rec(pid: str, rounds=(5, 5), seeking=()) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=100, round=rounds[0], rounds=list(rounds), digests=["aa"] * len(rounds),
                          seeking=[list(s) for s in seeking], tokens_per_second=1.0, client_mode=False, time=1.0)


def play(att: Attendance, records: dict, came: set, met=lambda p: True, here=(0, 6)):
    """One round: whom it waits for, then what it learns when ``came`` (with us) formed the group."""
    att.observe(records, [5, 5])  # (the records as read)
    wanted = att.expected(records, ME, [5, 5], met, here)
    became = att.record(invited=wanted, live=records, came=came | {ME}, me=ME, met=met, fragment=here[0])
    return wanted, became


def test_a_partner_that_never_comes_is_waited_for_twice_then_only_at_probes_of_growing_interval():
    att = Attendance(misses=2, max_interval=8)
    a, ghost = "A" * 46, "G" * 46
    records = {a: rec(a), ghost: rec(ghost)}
    invited = []
    for _ in range(30):
        wanted, became = play(att, records, came={a})
        invited.append(ghost in wanted)
        assert a in wanted and ME in wanted
        if len(invited) == 2:
            assert [b.who for b in became] == [ghost] and "came to none" in became[0].why
        else:
            assert became == []
    rounds_invited = [i for i, x in enumerate(invited) if x]
    # twice in a row, then probes after 1, 3, 7, 7, .. rounds skipped (intervals 2, 4, 8, capped at 8)
    assert rounds_invited[:6] == [0, 1, 3, 7, 15, 23], rounds_invited
    assert att.absent(ghost)


def test_an_absent_partner_that_comes_is_forgiven_at_once_and_one_that_seeks_this_round_is_waited_for():
    att = Attendance(misses=2)
    a, b = "A" * 46, "B" * 46
    records = {a: rec(a), b: rec(b)}
    play(att, records, came={a})
    play(att, records, came={a})
    assert att.absent(b) and b not in att.expected(records, ME, [5, 5], lambda p: True, (0, 6))
    # its record says it looks for a group for this very round (it is back): waited for; another round: not
    back = {a: rec(a), b: rec(b, seeking=[(0, 6)])}
    assert b in att.expected(back, ME, [5, 5], lambda p: True, (0, 6))
    assert b not in att.expected(back, ME, [5, 5], lambda p: True, (1, 6))
    play(att, records, came={a, b})  # it came to a group of ours (not waited for, but in time): forgiven
    assert not att.absent(b) and att.snapshot() == {}


def test_an_absent_partner_that_came_to_our_state_is_waited_for_until_it_misses_again():
    """The two sides of a healed partition: each absent for the other, their states apart (behind or ahead);
    once one downloaded the other's state and the records show one state, each side's groups wait for the
    other again. A record that never moves (a stuck process) is not back, and one back that still does not come
    must drift apart again."""
    a, b = "A" * 46, "B" * 46
    stuck = {a: rec(a), b: rec(b)}  # in step with us all along, and never comes
    for apart in ((3, 5), (5, 7)):  # B behind us (we are the larger side), or ahead (we are the smaller one)
        att = Attendance(misses=2, max_interval=8)
        play(att, stuck, came={a})
        play(att, stuck, came={a})
        assert att.absent(b) and b not in att.expected(stuck, ME, [5, 5], lambda p: True, (0, 6))
        for rounds, waited in ((apart, False), ((5, 3), False), ((5, 4), True)):  # the records as they are read
            records = {a: rec(a), b: rec(b, rounds=rounds)}
            att.observe(records, [5, 5])
            assert (b in att.expected(records, ME, [5, 5], lambda p: True, (0, 6))) == waited, rounds
        play(att, stuck, came={a})  # ... and it did not come: a miss
        assert b not in att.expected(stuck, ME, [5, 5], lambda p: True, (0, 6))


def alternate(att: Attendance, comes, rounds: int = 40, seeks: bool = False) -> dict[int, list[int]]:
    """Rounds of fragments 0 and 1 in turn, with partner A always and G when ``comes(fragment)`` (its record seeking
    each round when ``seeks``); returns, per fragment, the indices of that fragment's rounds that waited for G."""
    a, g = "A" * 46, "G" * 46
    waited: dict[int, list[int]] = {0: [], 1: []}
    for i in range(rounds):
        here = (i % 2, 6 + i // 2)
        records = {a: rec(a), g: rec(g, seeking=[here] if seeks else ())}
        wanted, _ = play(att, records, came={a} | ({g} if comes(here[0]) else set()), here=here)
        if g in wanted:
            waited[here[0]].append(i // 2)
    return waited


def test_a_partner_that_comes_to_one_fragment_only_is_absent_from_the_other():
    """A hostile leader of its own groups in fragment 0 that follows into ours in fragment 1 (bench/hostile_peer.py
    phantom_group): judged over every fragment alone, coming to fragment 1 forgave it at each round, and every round
    of fragment 0 waited ``matchmaking_time`` for it. Judged per fragment too, fragment 0 waits for it twice, then
    at probes only, and fragment 1 at every round; a peer that comes to neither is absent after two rounds, as
    before."""
    waited = alternate(Attendance(misses=2, max_interval=8), comes=lambda f: f == 1)
    assert waited[1] == list(range(20))
    assert waited[0] == [0, 1, 3, 7, 15], waited[0]  # probes after 1, 3, 7 rounds of fragment 0 skipped
    crashed = alternate(Attendance(misses=2, max_interval=8), comes=lambda f: False)
    assert crashed[0][0] == crashed[1][0] == 0 and 1 not in crashed[0], crashed  # rounds (0, 6), (1, 6), not (0, 7)
    assert len(crashed[0]) + len(crashed[1]) <= 9, crashed


def test_an_absent_partner_whose_record_seeks_every_round_and_never_comes_is_waited_for_at_probes_only():
    """A record saying it seeks this very round brings an absent partner back at once (it is back from an outage),
    but the record is the peer's to write: one that seeks every round and never comes (a hostile leader of its own
    groups, a peer stuck elsewhere) wins ``CLAIMS`` such waits, then only probes; coming forgives it."""
    att = Attendance(misses=2, max_interval=8, claims=2)
    waited = alternate(att, comes=lambda f: f == 1, seeks=True)
    assert waited[1] == list(range(20))
    assert waited[0][:4] == [0, 1, 2, 3] and len(waited[0]) <= 4 + 3, waited[0]  # 2 misses, 2 claims, probes
    # once it comes to a round of fragment 0, its claims are its own again
    a, g = "A" * 46, "G" * 46
    play(att, {a: rec(a), g: rec(g)}, came={a, g}, here=(0, 30))
    assert att.snapshot(0) == {} and not att.absent(g, 0)
    never = alternate(Attendance(misses=2, max_interval=8, claims=0), comes=lambda f: False, seeks=True)
    unbounded = alternate(Attendance(misses=2, max_interval=8, claims=10 ** 6), comes=lambda f: False, seeks=True)
    assert len(never[0]) + len(never[1]) <= 9 and len(unbounded[0]) + len(unbounded[1]) == 40, (never, unbounded)


def test_a_partner_that_comes_late_is_not_counted_absent_again_so_its_probe_comes_and_the_group_waits():
    """An absent partner back from an outage, a little out of phase: its record seeks each round only after the
    group assembled without it. Judged by whom the round waited for when it assembled, that is no miss, so its
    probe comes on time and the group waits for it (judged by the records after the group, each late round would
    count as a miss and the probe would never come)."""
    att = Attendance(misses=2, max_interval=8)
    a, b = "A" * 46, "B" * 46
    on_time = {a: rec(a), b: rec(b)}
    play(att, on_time, came={a})
    play(att, on_time, came={a})
    assert att.absent(b)
    invited = []
    for r in range(7, 12):
        wanted = att.expected(on_time, ME, [5, 5], lambda p: True, (0, r))  # as the group assembles
        invited.append(b in wanted)
        if b in wanted:
            break
        late = {a: rec(a), b: rec(b, seeking=[(0, r)])}  # then B's record seeks the round: it is late
        att.record(invited=wanted, live=late, came={a, ME}, me=ME, met=lambda p: True, fragment=0)
    assert invited == [False, True], invited  # probed at the first interval (2 rounds), not pushed back
    assert att.snapshot()[b][0] == 2  # late rounds were not counted as misses


def test_record_judges_the_invitation_it_is_given_and_expected_only_reads():
    """A round hands back its last invitation (when its group assembled): a peer it did not name is no miss,
    whatever the records say now. Asking whom a round waits for changes nothing."""
    att = Attendance(misses=1)
    a = "A" * 46
    first = att.expected({a: rec(a)}, ME, [5, 5], lambda p: True, (0, 6))
    last = att.expected({}, ME, [5, 5], lambda p: True, (0, 6))  # A's record expired before the group assembled
    assert a in first and a not in last and att.snapshot() == {}
    assert att.record(invited=last, live={a: rec(a)}, came={ME}, me=ME, met=lambda p: True, fragment=0) == []
    assert att.snapshot() == {}  # not invited: no miss
    assert [b.who for b in att.record(invited=first, live={a: rec(a)}, came={ME}, me=ME, met=lambda p: True,
                                      fragment=0)] == [a]


def test_strangers_are_judged_together_so_fresh_ids_do_not_buy_fresh_waits():
    att = Attendance(misses=2, max_interval=8)
    a = "A" * 46
    met = {a}.__contains__
    waits = 0
    for i in range(20):  # a sybil factory: two new made-up ids every round, none ever comes
        sybils = [f"{chr(65 + i % 26)}{i:02d}{k}".ljust(46, "s") for k in range(2)]
        records = {a: rec(a), **{s: rec(s) for s in sybils}}
        wanted, _ = play(att, records, came={a}, met=met)
        waits += any(s in wanted for s in sybils)
    assert att.absent(STRANGERS)
    assert waits <= 2 + 4, waits  # twice, then probes every 2, 4, 8 rounds: not every round
    # a genuine newcomer that reaches a round in time joins it: strangers are forgiven
    newcomer = "N" * 46
    play(att, {a: rec(a), newcomer: rec(newcomer)}, came={a, newcomer}, met=met)
    assert not att.absent(STRANGERS)
    # but a newcomer's record claiming to seek this round does not make a round wait while strangers are absent
    att2 = Attendance(misses=1)
    play(att2, {a: rec(a), "X" * 46: rec("X" * 46)}, came={a}, met=met)
    assert "N" * 46 not in att2.expected({newcomer: rec(newcomer, seeking=[(0, 6)])}, ME, [5, 5], met, (0, 6))


def test_strangers_that_never_come_stop_counting_even_when_no_group_assembles():
    """Sybils that never come, counted in the quorum, keep the partners below it: no group assembles, and a
    round that assembled no group judged no one, so they were waited for and counted for ever (bench/
    swarm_attacks.py sybil_majority: 0 of 76 rounds ok). A no-group round judges the strangers it waited for
    (partners only by groups); once strangers are absent they are invited at probes but no longer counted."""
    att = Attendance(misses=2, max_interval=8)
    partners, sybils = ["A" * 46, "B" * 46], [f"S{k}".ljust(46, "s") for k in range(6)]
    met = set(partners).__contains__
    records = {pid: rec(pid) for pid in partners + sybils}
    counted = []
    for here in [(0, 6), (1, 6), (0, 7), (1, 7), (0, 8), (1, 8)]:
        wanted = att.expected(records, ME, [5, 5], met, here)
        counted.append(len(att.counted(wanted, ME, met, here[0])))
        if len(att.counted(wanted, ME, met, here[0])) > 2 * 3:  # (quorum_size: more than half of the count) -> no group
            became = att.no_group(invited=wanted, live=records, me=ME, met=met, fragment=here[0])
        else:
            became = att.record(invited=wanted, live=records, came=set(partners) | {ME}, me=ME, met=met,
                                fragment=here[0])
        assert not any(b.who in partners for b in became)
    assert counted[:2] == [9, 9] and counted[2:] == [3] * 4, counted
    assert att.absent(STRANGERS) and not any(att.absent(p) for p in partners)
    # at a probe the strangers are invited again (a newcomer may be among them) but not counted
    probes = []
    for r in range(9, 20):
        wanted = att.expected(records, ME, [5, 5], met, (0, r))
        if any(s in wanted for s in sybils):
            probes.append(att.counted(wanted, ME, met, 0))
        att.record(invited=wanted, live=records, came=set(partners) | {ME}, me=ME, met=met, fragment=0)
    assert probes and all(c == frozenset(partners) | {ME} for c in probes)
    # a no-group round that waited for no stranger judges no one
    fresh = Attendance(misses=1)
    assert fresh.no_group(invited=frozenset({ME}), live=records, me=ME, met=met, fragment=0) == []
    assert not fresh.absent(STRANGERS)


def test_strangers_that_come_do_not_forgive_the_strangers_that_never_came():
    """At a fresh start every honest peer is a stranger to the others. Sybils' records keep the first rounds below
    the quorum until the strangers are absent; when the honest peers then meet for the first time, or a fresh id
    of the attacker's comes to one group, only those that came are forgiven: the sybils stay uninvited (but at
    probes) and uncounted, so the next rounds assemble. (Forgiving every stranger cost two more rounds of no
    group at each such meeting: bench/swarm_attacks.py sybil_majority.) Once no stranger that stayed away is
    live, newcomers start afresh."""
    att = Attendance(misses=2, max_interval=8)
    honest, sybils = ["A" * 46, "B" * 46, "C" * 46], [f"S{k}".ljust(46, "s") for k in range(6)]
    partners: set[str] = set()
    met = partners.__contains__
    records = {pid: rec(pid) for pid in honest + sybils}
    for here in [(0, 6), (1, 6)]:  # every id is a stranger, counted: 10 in all, a group of 4 is no quorum
        att.no_group(invited=att.expected(records, ME, [5, 5], met, here), live=records, me=ME, met=met,
                     fragment=here[0])
    assert att.absent(STRANGERS)
    wanted = att.expected(records, ME, [5, 5], met, (0, 7))
    att.record(invited=wanted, live=records, came=set(honest) | {ME}, me=ME, met=met, fragment=0)  # the honest meet
    partners.update(honest)
    assert att.absent(STRANGERS)
    later = [att.counted(att.expected(records, ME, [5, 5], met, (f, r)), ME, met, f) for f, r in [(1, 7), (0, 8)]]
    assert all(c == frozenset(honest) | {ME} for c in later), later
    # a fresh id of the attacker's that comes to a group is forgiven alone
    fresh = "F" * 46
    records[fresh] = rec(fresh)
    att.record(invited=att.expected(records, ME, [5, 5], met, (1, 8)), live=records,
               came=set(honest) | {fresh, ME}, me=ME, met=met, fragment=1)
    partners.add(fresh)
    assert att.absent(STRANGERS)
    assert not any(s in att.counted(att.expected(records, ME, [5, 5], met, (0, 9)), ME, met, 0) for s in sybils)
    # the sybils' records expire: the strangers' absence is forgotten with them
    for s in sybils:
        del records[s]
    att.record(invited=att.expected(records, ME, [5, 5], met, (1, 9)), live=records, came=set(records) | {ME},
               me=ME, met=met, fragment=1)
    assert not att.absent(STRANGERS)


def test_a_peer_catching_up_is_not_waited_for_and_not_counted_absent():
    att = Attendance(misses=1)
    a, joiner = "A" * 46, "J" * 46
    records = {a: rec(a), joiner: rec(joiner, rounds=(0, 0))}
    assert catching_up(records[joiner], [5, 5]) and not catching_up(records[a], [5, 5])
    # records lag: two rounds behind may be a heartbeat old, still waited for; ours unknown: everyone is
    assert not catching_up(rec(a, rounds=(3, 5)), [5, 5]) and not catching_up(records[joiner], [])
    for _ in range(3):
        wanted, became = play(att, records, came={a})
        assert joiner not in wanted and became == []
    assert att.snapshot() == {}


def test_memory_is_bounded_and_peers_no_longer_live_are_forgotten():
    att = Attendance(misses=1)
    a = "A" * 46
    many = {f"{i:046d}": rec(f"{i:046d}") for i in range(MAX_TRACKED + 100)}
    play(att, {a: rec(a), **many}, came={a})
    assert len(att.snapshot()) <= MAX_TRACKED
    play(att, {a: rec(a)}, came={a})
    assert att.snapshot() == {}


def test_a_group_assembles_early_only_when_we_expect_someone_else():
    assert early_assembly(frozenset({ME}), ME) is None
    assert early_assembly(frozenset({ME, "A"}), ME) == frozenset({ME, "A"})
    assert early_assembly(None, ME) is None
    assert early_assembly(frozenset({ME, "A"}), ME, at_least=3) is None  # (a group that could not apply)
