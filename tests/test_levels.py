"""Two-level rounds (peer/net/round/levels.py): the cut, the slot layout, and two groups of three on real loopback P2P
daemons whose reducers meet per slot: all six members hold the same bytes, the weighted mean of all six parts."""

import asyncio
import contextlib
import time

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo

from helpers import p2p_mesh, run_async
from peer.net.round.allreduce import AllReduceResult, run_allreduce
from peer.net.round.reducer import AllReduceServicer
from peer.net.round.group import PROTOCOL_VERSION, GroupError, GroupPlan, slot_bounds, slot_spans
from peer.net.round.levels import SlotLift, plan_levels, roster_sizes
from peer.net.flow.streams import StreamGuard
from peer.net.trust.exclusion import Offence
from peer.outer.aggregate import AggregationRule, Aggregator
from peer.outer.codec import get_codec, warm_up
from peer.outer.rounds import Span
from peer.proto import allreduce_pb2 as pb

NUMEL = 3000


@pytest.fixture(autouse=True, scope="module")
def _kernels_ready():
    """The codecs' CPU kernels compiled before the timed tests below (3 s part deadlines), as a peer has them
    before its first round (a fresh checkout compiles fp8's for seconds)."""
    for name in ("fp32", "fp8"):
        warm_up(get_codec(name))
BASE = "0" * 32  # a declared base digest (peer/net/policy/agreement.py): every member the same
MEAN = AggregationRule(kind=Aggregator.MEAN)


def test_plan_levels_keeps_one_group_up_to_the_cap_then_even_groups():
    assert plan_levels(16, 0) is None and plan_levels(16, 16) is None
    cut = plan_levels(16, 4)
    assert (cut.group_target, cut.groups, cut.slots) == (4, 4, 4)
    cut = plan_levels(9, 8)  # two groups of 5 and 4, not 8 and 1
    assert (cut.group_target, cut.groups, cut.slots) == (5, 2, 8)
    for live in range(2, 300):
        for cap in (2, 4, 8, 64):
            cut = plan_levels(live, cap)
            if cut:
                assert cut.group_target <= cap and cut.groups * cut.group_target >= live
                assert (cut.groups - 1) * cut.group_target < live  # no group left empty


def test_slot_spans_give_reducers_consecutive_slots_that_line_up_across_groups():
    bounds = slot_bounds(1000, 4, align=64)
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    for clients in ([False] * 4, [False, True, False], [False, False, False], [True, False]):
        spans, held = slot_spans(1000, 4, clients, align=64)
        covered = sorted(s for s in spans if s[1] > s[0])
        assert covered[0][0] == 0 and covered[-1][1] == 1000
        assert sorted(s for h in held for s in h) == [0, 1, 2, 3]  # every slot held once
        for span, slots in zip(spans, held):  # a span is exactly the union of its slots
            if slots:
                assert span == (bounds[slots[0]][0], bounds[slots[-1]][1])
        assert all(not h for h, client in zip(held, clients) if client)
    with pytest.raises(GroupError):
        slot_spans(1000, 2, [False, False, False], align=64)


def _group(gid: bytes, peer_ids, infos) -> GroupInfo:
    return GroupInfo(gid, tuple(peer_ids), tuple(i.SerializeToString() for i in infos))


def test_group_plan_goes_two_level_when_a_member_declares_slots_and_refuses_mixed_slot_counts():
    ids = ["a", "b", "c"]
    infos = [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=1.0, numel=NUMEL, slots=s,
                           span_key=bytes(32)) for s in (4, 0, 4)]
    plan = GroupPlan.from_group(_group(b"g", ids, infos), "b", get_codec("fp32"), NUMEL, "t")
    assert plan.slots == 4 and [len(h) for h in plan.held] == [1, 1, 2]
    infos[1].slots = 8
    with pytest.raises(GroupError, match="slot counts"):
        GroupPlan.from_group(_group(b"g", ids, infos), "b", get_codec("fp32"), NUMEL, "t")


async def _two_groups(deltas, weights, *, slots=3, alone=None, broken=None, sizes=(3, 3), expected=6,
                      bases=((BASE, 0), (BASE, 0))):
    """Members 0-2 form group A, 3-5 group B (``sizes``; 3 slots: reducer k of each group holds slot k). Each
    reducer's level 2 is formed directly: the holders of slot k in A and B. Member ``alone`` finds no level-2 group
    (its partner, after a wait, none either); member ``broken``'s level-2 all-reduce loses its partner's span.
    Every member declares ``expected`` peers; group g's members declare base and base round ``bases[g]``."""
    p2ps = await p2p_mesh(6)
    try:
        ids = [p.peer_id for p in p2ps]
        servicers = []
        for p in p2ps:
            s = AllReduceServicer(registration_timeout=2.0, part_timeout=3.0, stream_timeout=30.0,
                                  guard=StreamGuard(per_peer=16, total=64))
            await s.add_p2p_handlers(p)
            servicers.append(s)
        groups = {0: list(range(sizes[0])), 1: list(range(sizes[0], 6))}
        rendezvous: dict[int, dict[int, bytes]] = {k: {} for k in range(slots)}
        met = {k: asyncio.Event() for k in range(slots)}

        def lift_for(i: int, plan: GroupPlan) -> SlotLift:
            async def form(slot, gather, seconds, groups):
                if i == alone:
                    return None
                rendezvous[slot][i] = gather
                if len(rendezvous[slot]) == 2:
                    met[slot].set()
                with contextlib.suppress(asyncio.TimeoutError):  # then a group of whoever came, as matchmaking
                    await asyncio.wait_for(met[slot].wait(), 3.0)
                members = sorted(rendezvous[slot])
                if len(members) == 1:
                    return None  # (as matchmaking: level 2 asks for two)
                return GroupInfo(b"slot%d" % slot, tuple(ids[m] for m in members),
                                 tuple(rendezvous[slot][m] for m in members))

            async def run(slot_plan, part, weight, seconds):
                if i == broken:  # the partner's reducer is gone: its span of the slot is missing
                    return AllReduceResult([Span(0, 1, None)], [[]], pieces=[None])
                return await run_allreduce(p2ps[i], servicers[i], slot_plan, part, weight, part_timeout=3.0,
                                           allreduce_timeout=seconds, connect_timeout=2.0, chunk_bytes=4096)
            async def two():
                return 2
            return SlotLift(plan, form=form, run=run, deadline=time.monotonic() + 15.0, chunk_elems=1024, groups=two)

        async def member(i):
            g = int(i >= sizes[0])
            infos = [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=bases[g][0], base_round=bases[g][1],
                                   weight=weights[m], numel=NUMEL, slots=slots, expected=expected,
                                   span_key=servicers[m].signer.public) for m in groups[g]]
            group = _group(b"level1-%d" % g, [ids[m] for m in groups[g]], infos)
            plan = GroupPlan.from_group(group, ids[i], get_codec("fp32"), NUMEL, f"member {i}", MEAN)
            lift = lift_for(i, plan)
            return await run_allreduce(p2ps[i], servicers[i], plan, deltas[i], weights[i], part_timeout=3.0,
                                       allreduce_timeout=20.0, connect_timeout=2.0, chunk_bytes=4096, lift=lift)
        return await asyncio.gather(*[member(i) for i in range(6)])
    finally:
        for p in p2ps:
            await p.shutdown()


def test_two_groups_whose_reducers_meet_per_slot_hold_the_same_bytes_the_mean_of_all():
    torch.manual_seed(1)
    deltas = [torch.randn(NUMEL) for _ in range(6)]
    weights = [1.0, 2.0, 3.0, 1.0, 1.0, 4.0]
    results = run_async(_two_groups(deltas, weights))
    expected = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    got = [torch.cat([s.average for s in r.spans]) for r in results]
    assert all(r.complete for r in results)
    assert all(torch.equal(got[0], g) for g in got[1:])  # bit-identical in both groups, not just close
    # the level-2 parts are a group's combination in fp8 (about 2^-4 relative per element): close to the mean
    assert float((got[0] - expected).norm() / expected.norm()) < 0.05
    assert all(r.total_weight == pytest.approx(sum(weights)) for r in results)  # the weight of all six


def test_a_slot_that_no_two_groups_met_in_is_missing_in_both_groups_not_applied_apart():
    """Two groups of 3 of 6 expected peers whose slot-1 holders never meet: neither group holds a majority of the
    round alone, so slot 1 is missing in both (each applying its own average would leave two digests)."""
    torch.manual_seed(2)
    deltas = [torch.randn(NUMEL) for _ in range(6)]
    results = run_async(_two_groups(deltas, [1.0] * 6, alone=1))
    for r in results:
        assert [s.average is None for s in r.spans] == [False, True, False]
    assert all(torch.equal(results[0].spans[k].average, results[3].spans[k].average) for k in (0, 2))


def test_a_group_that_holds_the_majority_alone_keeps_its_slot_and_the_smaller_group_applies_none():
    """Groups of 4 and 2 of 6 expected (4 slots: A's member k holds slot k, B's members 4 and 5 slots 0-1 and 2-3);
    A's slot-1 holder meets no one: A (4 of 6) holds slot 1's average alone, B (2 of 6) loses member 4's span."""
    torch.manual_seed(4)
    deltas = [torch.randn(NUMEL) for _ in range(6)]
    results = run_async(_two_groups(deltas, [1.0] * 6, slots=4, alone=1, sizes=(4, 2)))
    bounds = slot_bounds(NUMEL, 4, get_codec("fp32").block_size)
    assert all(r.complete for r in results[:4]) and not any(r.complete for r in results[4:])
    a = [torch.cat([s.average for s in r.spans]) for r in results[:4]]
    assert all(torch.equal(a[0], g) for g in a[1:])  # one group: the same bytes
    start, end = bounds[1]
    own = sum(deltas[i][start:end] for i in range(4)) / 4  # slot 1: group A's own mean
    assert float((a[0][start:end] - own).norm() / own.norm()) < 0.05
    for r in results[4:]:  # B: member 4's span (slots 0-1) missing, member 5's (slots 2-3) the joint average
        assert [s.average is None for s in r.spans] == [True, False]
        assert torch.equal(r.spans[1].average, a[0][bounds[2][0]:bounds[3][1]])


def test_a_group_whose_base_is_not_level_2s_contributes_but_applies_no_slot():
    """Group B declares an older base than A's, with as many peers: level 2 takes A's (the later round); B's
    parts count in every slot (A's average is the mean of all six) but none of B's slots is applied."""
    torch.manual_seed(5)
    deltas = [torch.randn(NUMEL) for _ in range(6)]
    results = run_async(_two_groups(deltas, [1.0] * 6, bases=((BASE, 7), ("1" * 32, 6))))
    mean = sum(deltas) / 6
    assert all(r.complete for r in results[:3])
    got = torch.cat([s.average for s in results[0].spans])
    assert float((got - mean).norm() / mean.norm()) < 0.05
    assert all(s.average is None for r in results[3:] for s in r.spans)


def test_a_slot_whose_level_2_loses_a_span_is_missing_in_every_group_and_the_rest_applies():
    torch.manual_seed(3)
    deltas = [torch.randn(NUMEL) for _ in range(6)]
    results = run_async(_two_groups(deltas, [1.0] * 6, broken=2))
    # member 2 (slot 2's holder in group A) reduced nothing at level 2: its piece of the slot is missing for group
    # B's holder too, so slot 2 is missing in both groups (nobody diverges), and the other slots arrive
    for r in results:
        assert [s.average is None for s in r.spans] == [False, False, True]
    assert all(torch.equal(results[0].spans[k].average, results[3].spans[k].average) for k in (0, 1))


def test_a_level_2_member_whose_info_the_plan_leaves_out_is_named_as_an_offender():
    """A slot's level-2 group of our holder, another group's holder and a member whose info does not parse: the
    plan leaves it out, the slot goes on with the two, and the lift hands its offence to ``learn``."""
    learned, ran = [], []
    mine = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=1.0, numel=NUMEL, slots=4,
                         expected=8, span_key=bytes(32))
    level1 = GroupPlan.from_group(_group(b"g", ["a", "b", "c", "d"], [mine] * 4), "a", get_codec("fp32"), NUMEL,
                                  "t", MEAN)
    start, end = slot_bounds(NUMEL, 4, get_codec("fp32").block_size)[0]
    part = torch.ones(end - start)

    async def form(slot, gather, seconds, groups):  # (the other group's holder declares what we declare)
        return GroupInfo(b"l2", ("a", "x", "junk"), (gather, gather, b"\xff not a member info"))

    async def run(plan, values, weight, seconds):
        ran.append([str(p) for p in plan.peer_ids])
        return AllReduceResult([Span(0, values.numel(), values.clone())], [[0, 1]], total_weight=2 * weight,
                               pieces=[[(0, b"")]])

    async def groups():
        return 2

    lift = SlotLift(level1, form=form, run=run, deadline=time.monotonic() + 10, chunk_elems=1024, groups=groups,
                    learn=learned.extend)
    assert run_async(lift._slot(0, part, 1.0, 2)).total_weight == 2.0
    assert ran == [["a", "x"]]
    assert [(v.peer, v.offence) for v in learned] == [("junk", Offence.BAD_INFO)]


def test_roster_reads_take_only_plausible_group_sizes():
    from types import SimpleNamespace as V

    found = V(value={"a": V(value=4), "b": V(value=0), "c": V(value=True), "d": V(value=10**9), "e": V(value="4"),
                     "f": V(value=3)})
    assert roster_sizes(found, limit=16) == [4, 3]
    assert roster_sizes(found, limit=1) == [4]
    assert roster_sizes(None, 16) == [] and roster_sizes(V(value=[1, 2]), 16) == []


@pytest.mark.timeout(120)
def test_the_roster_counts_the_groups_once_they_hold_every_live_peer_else_at_the_cutoff(tmp_path):
    """Two level-1 groups (3 and 2 peers) announce themselves: with 5 live peers both holders count 2 groups as
    soon as both entries are in; with 6 (one live peer in no group) they count 2 at the cutoff."""
    from helpers import dht_nodes
    from peer.net.round.levels import GroupCensus

    with dht_nodes(2, tmp_path) as dhts:
        async def count(live: int, prefix: str, cutoff: float):
            censuses = [GroupCensus(dhts[i], prefix, group_id=bytes([i]) * 8, size=size, live=live, cutoff=cutoff,
                              request_timeout=3.0, ttl=30.0, poll=0.2) for i, size in ((0, 3), (1, 2))]
            t0 = time.monotonic()
            counts = await asyncio.gather(*[r.groups() for r in censuses])
            return counts, time.monotonic() - t0

        counts, took = run_async(count(5, "run_f0_r1", cutoff=20.0))
        assert counts == [2, 2] and took < 15.0
        counts, took = run_async(count(6, "run_f0_r2", cutoff=3.0))
        assert counts == [2, 2] and took >= 2.5
