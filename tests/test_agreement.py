"""Which members of a group apply its average (peer/net/policy/agreement.py): one base per group, one group per
round."""

from hivemind.averaging.group_info import GroupInfo
from hypothesis import given
from hypothesis import strategies as st

from peer.net.policy.agreement import agree, our_count_holds, quorum_peers, quorum_size, slot_verdict
from peer.net.policy.consensus import plan_owed
from peer.net.round.group import PROTOCOL_VERSION, GroupPlan
from peer.net.trust.records import ProgressRecord
from peer.outer.codec import get_codec
from peer.proto import allreduce_pb2 as pb

A, B, C = "a" * 32, "b" * 32, "c" * 32


def infos(bases, expected=None, rounds=None):
    n = len(bases)
    return [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=1.0, numel=10, base=b, span_key=bytes(32),
                          base_round=(rounds or [0] * n)[i], expected=(expected or [n] * n)[i])
            for i, b in enumerate(bases)]


def test_the_base_most_members_declared_applies_and_the_others_only_contribute():
    v = agree(infos([A, B, A]), two_level=False)
    assert (v.base, v.appliers, v.quorum) == (A, (0, 2), True)
    # a tie goes to the later round (a peer resumed from an old checkpoint is the one that catches up) ...
    v = agree(infos([A, B], rounds=[4, 5]), two_level=False)
    assert (v.base, v.base_round, v.appliers) == (B, 5, (1,))
    # ... then to the smaller digest; a base's round is the smallest its holders declared (no lifting it)
    assert agree(infos([B, A]), two_level=False).appliers == (1,)
    v = agree(infos([A, B, B], rounds=[9, 3, 99]), two_level=False)
    assert (v.base, v.base_round) == (B, 3)


def test_a_group_applies_only_with_more_than_half_of_the_peers_its_members_expected():
    assert agree(infos([A, A], expected=[3, 3]), two_level=False).quorum  # 2 of 3
    v = agree(infos([A, A], expected=[4, 4]), two_level=False)  # 2 of 4: the other half may apply it
    assert not v.quorum and v.expected == 4
    # the upper median of the declared counts: one member with a stale view does not decide ...
    assert not agree(infos([A, A], expected=[2, 16]), two_level=False).quorum
    # ... nor does one that declares an absurd count in a larger group
    assert agree(infos([A, A, A], expected=[3, 3, 10 ** 9]), two_level=False).quorum
    assert agree(infos([A, A], expected=[16, 16]), two_level=True).quorum  # bounded groups meet at level 2


@given(n=st.integers(2, 40), cut=st.integers(1, 39), bases=st.lists(st.sampled_from([A, B, C]), min_size=40,
                                                                   max_size=40))
def test_two_groups_of_one_round_never_both_apply_and_every_applier_has_the_groups_base(n, cut, bases):
    """Peers that agree on how many the round waits for (n) split into two groups: at most one applies, and inside
    it every member that applies declared the one base."""
    cut = min(cut, n - 1)
    groups = [bases[:cut], bases[cut:n]]
    verdicts = [agree(infos(g, expected=[n] * len(g)), two_level=False) for g in groups]
    assert sum(v.quorum for v in verdicts) <= 1
    for g, v in zip(groups, verdicts):
        assert {g[i] for i in v.appliers} == {v.base}
        assert len(v.appliers) == max(g.count(b) for b in set(g))


def level2(groups, expected, cap=4):
    """A slot's level-2 infos: one per level-1 group (base, size), each declaring ``expected``."""
    return [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=1.0, numel=10, base=b, expected=expected,
                          members=size, span_key=bytes(32)) for b, size in groups]


def test_a_slots_level_2_group_counts_each_holder_for_its_groups_peers():
    assert slot_verdict(level2([(A, 4), (A, 4)], expected=8), cap=4).quorum  # 8 of 8
    assert not slot_verdict(level2([(A, 4)], expected=8), cap=4).quorum  # a group alone: 4 of 8
    assert slot_verdict(level2([(A, 3)], expected=5), cap=4).quorum  # 3 of 5: the majority alone
    assert not slot_verdict(level2([(A, 200)], expected=8), cap=4).quorum  # a holder counts for a full group at most
    assert not slot_verdict(level2([(A, 0), (A, 0)], expected=8), cap=4).quorum  # and for its own peer at least
    # the base most peers hold wins, not the base most holders declared
    v = slot_verdict(level2([(A, 1), (B, 4), (A, 1)], expected=6), cap=4)
    assert (v.base, v.appliers, v.quorum, v.counted) == (B, (1,), True, 6)


@given(n=st.integers(5, 40), cap=st.integers(2, 8), data=st.data())
def test_per_slot_majorities_leave_every_applying_group_with_the_same_bytes(n, cap, data):
    """n peers in level-1 groups of at most ``cap`` meet per slot in level-2 groups formed any way (groups that
    came together, late ones apart): at most one level-2 group per slot applies, and the level-1 groups that apply
    every slot they hold were in the same level-2 group of every slot."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(n - sum(sizes), data.draw(st.integers(1, cap))))
    slots, applying = cap, set(range(len(sizes)))
    met: list[dict[int, int]] = []  # per slot: level-1 group -> its level-2 group there
    for _ in range(slots):
        where = {g: data.draw(st.integers(0, 2)) for g in range(len(sizes))}
        met.append(where)
        quorate = 0
        for l2 in set(where.values()):
            members = [g for g in range(len(sizes)) if where[g] == l2]
            v = slot_verdict(level2([(A, sizes[g]) for g in members], expected=n), cap)
            quorate += v.quorum
            if not v.quorum:
                applying -= set(members)
        assert quorate <= 1
    for where in met:
        assert len({where[g] for g in applying}) <= 1


def count(*args, **kwargs) -> int:
    return len(quorum_peers(*args, **kwargs))


def test_partners_that_stay_live_keep_counting_so_the_smaller_side_of_a_split_never_holds_a_majority():
    five = ["p1", "p2", "p3", "p4", "p5"]
    partnered = set(five).__contains__
    # split 3 | 2: each side's rounds stopped waiting for the other (absent), whose records still arrive
    major = count(["p2", "p3"], five, partnered, "p1")
    minor = count(["p5"], five, partnered, "p4")
    assert (major, minor) == (5, 5)
    assert agree(infos([A] * 3, expected=[major] * 3), two_level=False).quorum
    assert not agree(infos([B] * 2, expected=[minor] * 2), two_level=False).quorum
    # the other side crashed: its records expired, the survivors go on
    assert count(["p5"], ["p4", "p5"], partnered, "p4") == 2
    # made-up ids that never were in a group count only while the round waits for them
    sybils = [f"s{i}" for i in range(20)]
    assert count(["p2"], ["p2", *sybils], partnered, "p1") == 2
    assert count(["p2", *sybils], ["p2", *sybils], partnered, "p1") == 22
    # a real peer we never met (our daemon answers for it, one per host) keeps counting once no longer waited for:
    # a peer a hostile leader kept from the others since its first round still counts them
    assert count([], ["p2", "p3", *sybils], lambda p: False, "p1", anchored=["p2", "p3"]) == 3
    # a leader assembles only a group that could apply: more than half of its count
    assert [quorum_size(n, 2) for n in (1, 2, 3, 4, 5, 6)] == [2, 2, 2, 3, 3, 4]
    for n in range(2, 40):
        q = quorum_size(n, 1)
        assert agree(infos([A] * q, expected=[n] * q), two_level=False).quorum
        assert not agree(infos([A] * (q - 1), expected=[n] * (q - 1)), two_level=False).quorum, n


@given(n=st.integers(2, 30), cut=st.integers(1, 29), sybils=st.lists(st.integers(0, 20), min_size=2, max_size=2),
       declared=st.integers(0, 2 ** 32 - 1), theirs=st.sampled_from([A, B]))
def test_made_up_members_and_what_they_declare_never_make_a_second_group_apply(n, cut, sybils, declared, theirs):
    """n honest peers that count the same peers, on one base, split into two groups of a round; a hostile client
    adds made-up ids (which no honest peer counts) to either group, each declaring any count and any base. The
    group verdict can be won that way; with our own count as well, at most one group holds an honest applier."""
    cut = min(cut, n - 1)
    honest = [f"h{i}" for i in range(n)]
    applying = 0
    for g, (members, extra) in enumerate(zip([honest[:cut], honest[cut:]], sybils)):
        ids = members + [f"s{g}.{i}" for i in range(extra)]
        declared_infos = infos([A] * len(members) + [theirs] * extra, expected=[n] * len(members) + [declared] * extra)
        verdict = agree(declared_infos, two_level=False)
        ours = our_count_holds(ids, declared_infos, verdict.base, honest)
        applying += verdict.quorum and ours and 0 in verdict.appliers  # (member 0: an honest one)
    assert applying <= 1


def test_a_group_of_made_up_ids_wins_the_verdict_but_not_our_own_count():
    """A hostile leader's group: one honest peer (which counts 5) and four ids of its own declaring a count of 1."""
    counted = {"h0", "h1", "h2", "h3", "h4"}
    ids = ["h0", "s1", "s2", "s3", "s4"]
    declared = infos([A] * 5, expected=[5, 1, 1, 1, 1])
    verdict = agree(declared, two_level=False)
    assert verdict.quorum and verdict.expected == 1  # the median is theirs
    assert not our_count_holds(ids, declared, A, counted)
    # three of five: a majority of ours, whatever the made-up ids among them
    assert our_count_holds(["h0", "h1", "h2", "s1"], infos([A] * 4), A, counted)
    assert not our_count_holds(["h0", "h1"], infos([A] * 2), A, counted)
    # ... unless they chose the group's base: their four against our three
    declared = infos([A, A, A, B, B, B, B])
    base = agree(declared, two_level=False).base
    assert base == B and not our_count_holds(["h0", "h1", "h2", "s1", "s2", "s3", "s4"], declared, base, counted)


def test_group_plan_checks_the_declared_base_and_says_whether_we_apply():
    ids = ["p0", "p1", "p2"]
    gathered = [i.SerializeToString() for i in infos([A, B, A])]
    plans = [GroupPlan.from_group(GroupInfo(b"g" * 20, tuple(ids), tuple(gathered)), me, get_codec("fp32"), 10, "t")
             for me in ids]
    assert [p.applies for p in plans] == [True, False, True]
    for bad in ("", "ZZ" * 16, "a" * 65):  # a malformed base: that member is left out, named
        gathered[1] = infos([bad])[0].SerializeToString()
        plan = GroupPlan.from_group(GroupInfo(b"g" * 20, tuple(ids), tuple(gathered)), "p0", get_codec("fp32"), 10,
                                    "t")
        assert plan.peer_ids == ("p0", "p2") and plan.dropped == (("p1", "a malformed base digest"),), bad


def _rec(pid, round_, digest):
    return ProgressRecord(peer_id=pid, step=10, round=round_, rounds=[round_], digests=[digest], tokens_per_second=1.0,
                          client_mode=False, time=100.0)


def test_an_off_base_member_downloads_what_the_appliers_hold_once_their_records_show_it():
    ids = ["12D3KooW" + c * 44 for c in "xyz"]
    records = {ids[0]: _rec(ids[0], 6, "d" * 32), ids[1]: _rec(ids[1], 6, "d" * 32), ids[2]: _rec(ids[2], 9, "e" * 32)}
    plan = plan_owed(records, 0, 7, ids[:2], "off base")
    assert plan.wait  # their records still show round 6
    records[ids[0]] = _rec(ids[0], 7, "f" * 32)
    records[ids[1]] = _rec(ids[1], 7, "f" * 32)
    plan = plan_owed(records, 0, 7, ids[:2], "off base")  # (the third peer, not an applier, is not asked)
    assert (plan.wait, plan.round, plan.digest, sorted(plan.donors)) == (False, 7, "f" * 32, sorted(ids[:2]))
