"""Signed spans: one version of every round, or a proof of who sent two (pure: no I/O, no torch).

A reducer sends every member its span's average as the same bytes; a hostile one can send two versions, each
plausible to the member that gets it, and the members that apply the round then hold two digests. So each reducer
signs the digest of its average (:func:`span_digest`: the group, the span, the contributors, the total weight and
every piece) with the Ed25519 key its ``MemberInfo.span_key`` declares, and after its average sends each member
the list of what its own member side received and accepted of every span (:class:`Seen`, signatures included).
A reducer that sent two versions is caught by any member that got the other one, and the two signatures prove it
(``Offence.EQUIVOCATION``: excluded at once); an entry that differs without its reducer's valid signature is a lie
of the list's sender. Which spans a member applies (:func:`may_apply`): all of them, or, where some are missing, the
ones every list says came, if they are more than half (so two such sets always share a list). Keys are the members'
own for the round, bound by their declaration to the group: a hostile leader that swaps a declared key makes that
reducer's signatures fail for the members it told, which then miss its span; it cannot make a proof.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from peer.proto import allreduce_pb2 as pb

KEY_BYTES, SIGNATURE_BYTES = 32, 64
_DOMAIN = b"swarmloco span v1\0"


class SpanSigner:
    """This peer's signing key for its spans' averages (one per process: each group binds it by our declaration)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes_raw()

    def sign(self, group_id: bytes, span: int, digest: bytes) -> bytes:
        return self._key.sign(_statement(group_id, span, digest))


def _statement(group_id: bytes, span: int, digest: bytes) -> bytes:
    return _DOMAIN + struct.pack(">I", len(group_id)) + group_id + struct.pack(">I", span) + digest


def span_digest(group_id: bytes, span: int, responses: Sequence[pb.ReduceResponse]) -> bytes:
    """The SHA-256 digest of an average's messages (contributors and total weight from the first, every piece with
    its offset), bound to its group and span. Per-member fields (timings, credits, the signature) are left out."""
    h = hashlib.sha256(_statement(group_id, span, b""))
    first = responses[0]
    h.update(struct.pack(">I", len(first.contributors)) + b"".join(struct.pack(">I", c) for c in first.contributors))
    h.update(struct.pack(">d", first.total_weight))
    for msg in responses:
        piece = msg.piece.SerializeToString(deterministic=True)
        h.update(struct.pack(">QQ", msg.offset, len(piece)) + piece)
    return h.digest()


def signed_by(key: bytes, group_id: bytes, span: int, digest: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``key``'s on ``digest`` as the average of span ``span`` of group ``group_id``."""
    if len(key) != KEY_BYTES or len(signature) != SIGNATURE_BYTES or not digest:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, _statement(group_id, span, digest))
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass(frozen=True)
class Seen:
    """What one member received of one span: the average's digest and its reducer's signature (empty: none)."""

    digest: bytes = b""
    signature: bytes = b""

    def to_wire(self) -> pb.SpanSeen:
        return pb.SpanSeen(digest=self.digest, signature=self.signature)


@dataclass
class CrossCheck:
    """:func:`cross_check`'s findings: ``equivocated`` {span: why} (its reducer signed two digests), ``lied`` {list
    sender's index: why} (an entry that differs without its reducer's valid signature, or a malformed list),
    ``missing`` (reducers whose list did not come); of the lists that came, ``short`` {sender: spans we hold that
    its list lacks} and ``beyond`` {sender: spans its list holds that we lack}. :func:`may_apply` decides."""

    equivocated: dict[int, str] = field(default_factory=dict)
    lied: dict[int, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    short: dict[int, list[int]] = field(default_factory=dict)
    beyond: dict[int, list[int]] = field(default_factory=dict)

    @property
    def agrees(self) -> bool:
        """No version or list is in question (whether the spans held differ is :func:`may_apply`'s)."""
        return not (self.equivocated or self.lied or self.missing)


def cross_check(group_id: bytes, keys: Sequence[bytes], mine: Sequence[Seen],
                lists: Mapping[int, Optional[Sequence[pb.SpanSeen]]]) -> CrossCheck:
    """Compares what we received and accepted of each span (``mine``, in span order; our own span included) with
    the lists of the reducers whose spans we hold (``lists`` {reducer index: its list, None if it did not come});
    ``keys``: every member's declared span key. Two entries agree on the version when either is empty or the
    digests are equal; where one is empty and the other not, the list goes to ``short`` or ``beyond``."""
    found = CrossCheck()
    for k, entries in sorted(lists.items()):
        if entries is None:
            found.missing.append(k)
            continue
        if len(entries) != len(mine):
            found.lied[k] = f"a list of {len(entries)} spans for {len(mine)}"
            continue
        for j, (ours, theirs) in enumerate(zip(mine, entries)):
            if bool(ours.digest) != bool(theirs.digest):
                (found.short if ours.digest else found.beyond).setdefault(k, []).append(j)
            if not ours.digest or not theirs.digest or theirs.digest == ours.digest:
                continue
            if signed_by(keys[j], group_id, j, theirs.digest, theirs.signature):
                found.equivocated[j] = f"two digests of span {j}, each signed by its reducer (one from member {k})"
            else:
                found.lied.setdefault(k, f"span {j}: a digest that its reducer did not sign")
    return found


def enough_held(held: int, live: int, *, partial: bool) -> bool:
    """Whether ``held`` of a group's ``live`` spans are enough to apply (:func:`may_apply`): all of them, or with
    ``partial`` more than half. Below that no list needs reading."""
    return held == live or (partial and 2 * held > live)


def may_apply(mine: Sequence[Seen], found: CrossCheck, live: Sequence[int], *, partial: bool) -> bool:
    """Whether a member applies the spans it holds (``mine``, as published; ``live``: the spans of at least one
    element; ``found``: the cross-check of the lists of the reducers of the spans it holds). Every peer that
    applies then applies the same spans, given one honest reducer among those of any two such members' spans:

    - all of them, if no span is lacking from more than half of the lists (a member that applies without span j
      holds more than half of the spans, each of whose lists lacks j: it would be more than half of ours);
    - with ``partial`` (a one-level group: a two-level round's other groups apply every slot), only those it holds,
      if they are more than half of ``live`` and every list says exactly that: two such sets share a list.
    """
    held = [j for j in live if mine[j].digest]
    if not found.agrees or not enough_held(len(held), len(live), partial=partial):
        return False
    if len(held) == len(live):
        lacking = Counter(j for spans in found.short.values() for j in spans)
        return all(2 * lacking[j] <= len(live) for j in live)
    return not found.short and not found.beyond
