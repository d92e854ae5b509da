"""Signed spans (peer/net/trust/span_proofs.py): what a digest covers, whose signature verifies, and what the
cross-check of every reducer's list concludes."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from peer.net.trust.span_proofs import Seen, SpanSigner, cross_check, may_apply, signed_by, span_digest
from peer.outer.codec import get_codec
from peer.proto import allreduce_pb2 as pb

GID = b"g" * 20
CODEC = get_codec("e3m0")


def average(values: torch.Tensor, contributors=(0, 1, 2), total=3.0) -> list[pb.ReduceResponse]:
    """An average's messages as a reducer sends them: two pieces, the metadata on the first."""
    half = values.numel() // 2
    msgs = [pb.ReduceResponse(offset=0, piece=CODEC.encode_flat(values[:half])),
            pb.ReduceResponse(offset=half, piece=CODEC.encode_flat(values[half:]))]
    msgs[0].contributors.extend(contributors)
    msgs[0].total_weight = total
    return msgs


def test_the_digest_covers_every_piece_the_metadata_the_group_and_the_span_and_nothing_per_member():
    torch.manual_seed(0)
    values = torch.randn(256)
    base = span_digest(GID, 1, average(values))
    assert span_digest(GID, 1, average(values.clone())) == base  # the same bytes, the same digest
    changed = average(values)
    changed[1].piece.data = bytes([changed[1].piece.data[0] ^ 1]) + changed[1].piece.data[1:]
    others = [span_digest(GID, 1, average(values * 1.02)), span_digest(GID, 1, changed),
              span_digest(GID, 1, average(values, contributors=(0, 1))),
              span_digest(GID, 1, average(values, total=2.0)),
              span_digest(b"h" * 20, 1, average(values)), span_digest(GID, 2, average(values))]
    assert len({base, *others}) == 1 + len(others)
    timed = average(values)  # what _send_average sets per member, and the signature itself, are not covered
    timed[0].part_seconds, timed[0].part_bytes, timed[0].signature = 1.5, 99, b"x" * 64
    assert span_digest(GID, 1, timed) == base


def test_a_signature_verifies_only_under_its_key_for_its_group_span_and_digest():
    signer, other = SpanSigner(), SpanSigner()
    digest = span_digest(GID, 0, average(torch.ones(128)))
    signature = signer.sign(GID, 0, digest)
    assert signed_by(signer.public, GID, 0, digest, signature)
    assert not signed_by(other.public, GID, 0, digest, signature)
    assert not signed_by(signer.public, b"h" * 20, 0, digest, signature)
    assert not signed_by(signer.public, GID, 1, digest, signature)
    assert not signed_by(signer.public, GID, 0, bytes(32), signature)
    for key, sig in ((b"", signature), (signer.public[:31], signature), (signer.public, signature[:63]),
                     (signer.public, b""), (bytes(32), signature)):
        assert not signed_by(key, GID, 0, digest, sig)  # (malformed keys and signatures: False, no exception)


def _seen(signer: SpanSigner, span: int, values: torch.Tensor) -> Seen:
    digest = span_digest(GID, span, average(values))
    return Seen(digest, signer.sign(GID, span, digest))


def test_the_cross_check_applies_only_when_every_list_agrees_and_names_who_sent_two_versions_or_lied():
    """Three reducers. Lists that agree (or are silent on a span) let the round apply; another version of span 2
    signed by its reducer is proof against reducer 2, whoever's list carries it; one its reducer did not sign is
    the list's sender's lie; a list that did not come, or of another length, keeps the round from applying."""
    signers = [SpanSigner() for _ in range(3)]
    keys = [s.public for s in signers]
    torch.manual_seed(1)
    spans = [torch.randn(128) for _ in range(3)]
    mine = [_seen(signers[j], j, spans[j]) for j in range(3)]
    wire = [m.to_wire() for m in mine]
    assert cross_check(GID, keys, mine, {1: wire, 2: wire}).agrees
    silent = [wire[0], pb.SpanSeen(), wire[2]]  # (reducer 1 did not get span 1: it vouches for nothing there)
    assert cross_check(GID, keys, mine, {1: silent, 2: wire}).agrees

    two_faced = list(wire)
    two_faced[2] = _seen(signers[2], 2, spans[2] * 1.02).to_wire()
    found = cross_check(GID, keys, mine, {1: two_faced, 2: wire})
    assert not found.agrees and list(found.equivocated) == [2] and not found.lied and not found.missing
    assert "member 1" in found.equivocated[2]

    forged = list(wire)
    forged[0] = pb.SpanSeen(digest=bytes(32), signature=signers[1].sign(GID, 0, bytes(32)))  # (1 signs for 0)
    found = cross_check(GID, keys, mine, {1: forged, 2: wire})
    assert not found.agrees and list(found.lied) == [1] and not found.equivocated

    found = cross_check(GID, keys, mine, {1: None, 2: wire[:2]})
    assert found.missing == [1] and list(found.lied) == [2]
    assert cross_check(GID, keys, mine, {2: wire}).agrees  # (a liar we excluded is not asked: its list is not read)


def _lists(held: list[set[int]], listers: range, *, came=lambda k, m: True) -> list[dict]:
    """What each member m reads: the list of every reducer k whose span it holds (k's list is what k holds)."""
    seen = [[Seen(b"d%d" % j, b"") if j in held[m] else Seen() for j in range(len(listers))] for m in range(len(held))]
    return [{k: [e.to_wire() for e in seen[k]] if came(k, m) else None for k in held[m] if k != m and k in listers}
            for m in range(len(held))]


def _applies(held: set[int], lists: dict, n: int, *, partial: bool = True) -> bool:
    mine = [Seen(b"d%d" % j, b"") if j in held else Seen() for j in range(n)]
    return may_apply(mine, cross_check(GID, [KEYS] * n, mine, lists), list(range(n)), partial=partial)


KEYS = bytes(32)


def test_a_member_applies_every_span_or_a_majority_that_every_list_holds():
    """Five reducers. A span missing for everyone (a dead or erring reducer): the four others are applied by all.
    Missing for one member only: that member applies nothing, the others all five. Three of five held, lists
    that say otherwise, two of five, or a two-level group (``partial`` False): nothing."""
    n = 5
    everyone_but_4 = [set(range(4))] * 4 + [set(range(5))]
    lists = _lists(everyone_but_4, range(n))
    assert all(_applies(everyone_but_4[m], lists[m], n) for m in range(4))
    assert not any(_applies(everyone_but_4[m], lists[m], n, partial=False) for m in range(4))
    one_short = [set(range(5)) - {3} if m == 0 else set(range(5)) for m in range(n)]
    lists = _lists(one_short, range(n))
    assert [_applies(one_short[m], lists[m], n) for m in range(n)] == [False, True, True, True, True]
    three = [set(range(3))] * 3 + [set(range(5))] * 2  # (reducers 3 and 4 reached only each other)
    lists = _lists(three, range(n))
    assert [_applies(three[m], lists[m], n) for m in range(n)] == [True, True, True, False, False]
    assert not _applies({0, 1}, _lists([{0, 1}] * 5, range(n))[0], n)  # (two of five: too few)
    more = [{0, 1, 2}] * 3 + [{0, 1, 2, 3}, set()]  # (span 3 reached its own reducer only; span 4 nobody)
    lists = _lists(more, range(n))
    assert [_applies(more[m], lists[m], n) for m in range(4)] == [True, True, True, False]
    mine = [Seen(b"d%d" % j, b"") if j < 4 else Seen() for j in range(n)]
    gone = _lists([set(range(4))] * 5, range(n), came=lambda k, m: k != 2)[0]
    assert not may_apply(mine, cross_check(GID, [KEYS] * n, mine, gone), list(range(n)), partial=True)


@settings(max_examples=500, deadline=None)
@example(n=5, drops=[{3, 4}] * 3 + [{4}] * 4, lost_lists=[])  # (a majority that lacks a span one member holds)
@given(n=st.integers(2, 7), drops=st.lists(st.sets(st.integers(0, 6), max_size=3), min_size=7, max_size=7),
       lost_lists=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=6))
def test_every_honest_member_that_applies_applies_the_same_spans(n, drops, lost_lists):
    """The invariant, for honest reducers whatever the network drops: member m misses the spans ``drops[m]`` (its
    own included: a reduction that failed), and the list of k for each (k, m) in ``lost_lists``. Every member
    that applies applies the same set of spans."""
    held = [set(range(n)) - drops[m] for m in range(n)]
    lists = _lists(held, range(n), came=lambda k, m: (k, m) not in lost_lists)
    applied = {frozenset(held[m]) for m in range(n) if _applies(held[m], lists[m], n)}
    assert len(applied) <= 1, (held, applied)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(3, 7), gets=st.lists(st.booleans(), min_size=7, max_size=7),
       claims=st.lists(st.booleans(), min_size=7, max_size=7))
def test_a_reducer_that_picks_who_gets_its_span_and_what_its_list_says_splits_no_round(n, gets, claims):
    """One hostile reducer (the last) gives its span to the members of its choice (``gets``) and tells each member
    a list of its choice about its own span (``claims``; other entries it can only drop, which only keeps a round
    from applying). Honest reducers reach each other. Every honest member that applies applies the same spans."""
    h = n - 1
    held = [set(range(n)) - ({h} if not gets[m] else set()) for m in range(h)] + [set(range(n))]
    lists = _lists(held, range(n))
    for m in range(h):
        if h in lists[m]:
            lists[m][h] = [Seen(b"d%d" % j, b"").to_wire() if j != h or claims[m] else pb.SpanSeen()
                           for j in range(n)]
    applied = {frozenset(held[m]) for m in range(h) if _applies(held[m], lists[m], n)}
    assert len(applied) <= 1, (held, applied)
