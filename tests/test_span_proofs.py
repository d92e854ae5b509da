"""Signed spans (peer/net/trust/span_proofs.py): what a digest covers, whose signature verifies, and what the
cross-check of every reducer's list concludes."""

from __future__ import annotations

import torch

from peer.net.trust.span_proofs import Seen, SpanSigner, cross_check, signed_by, span_digest
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
