"""Member claims (peer/net/trust/claims.py): what counts as a member's word that it is in a group, what a peer may
publish of it (peer/net/witness.py, through real DHT nodes), and what proves a second group of the same round."""

from __future__ import annotations

import base64

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hivemind.dht.protocol import DHTProtocol
from hivemind.utils import get_dht_time

from helpers import dht_nodes, run_async
from peer.errors import SetupError
from peer.net.plumbing.dht import shutdown_dht
from peer.net.plumbing.dht_storage import BOUNDS
from peer.net.trust.auth import peer_id_of
from peer.net.trust.claims import (CLAIM_PEER_CHARS, GROUP_ID_CHARS, MAX_CLAIMS, SIGNATURE_CHARS, ClaimBook,
                                   ClaimSigner, claim_entries, claims_key, equivocations, parse_entries, statement,
                                   two_groups)
from peer.net.trust.exclusion import Exclusions, Offence
from peer.net.trust.progress import make_validators
from peer.net.witness import Witness
from peer.proto import allreduce_pb2 as pb

RUN, GID, OTHER = "run", b"g" * 20, b"o" * 20
SIGNERS = [ClaimSigner(RSAPrivateKey(), RUN) for _ in range(3)]
IDS = [peer_id_of(s._key.get_public_key()) for s in SIGNERS]
STMT = statement(RUN, 1, 7, GID)


def sign(i: int, stmt: bytes) -> pb.MemberClaim:
    """Member i's claim of ``stmt`` signed with its key directly, as a modified client signs any number of them."""
    return pb.MemberClaim(key=SIGNERS[i].public, signature=SIGNERS[i]._key.sign(stmt))


def test_a_statement_names_the_run_the_fragment_the_round_and_the_group():
    variants = [statement("run2", 1, 7, GID), statement(RUN, 0, 7, GID), statement(RUN, 1, 8, GID),
                statement(RUN, 1, 7, OTHER), statement(RUN, 1, 7, GID + b"\0")]
    assert len({STMT, *variants}) == 6


def test_a_book_keeps_only_each_members_own_valid_claim_for_the_group():
    full: list = []  # (the book's one call once every member's claim is in)
    book = ClaimBook(STMT, IDS, (0, sign(0, STMT)), on_full=full.append)
    assert set(book.held) == {0}
    assert not book.add(1, sign(2, STMT))  # another member's key: not member 1's word
    assert not book.add(1, sign(1, statement(RUN, 1, 7, OTHER)))  # its claim for another group
    assert not book.add(1, pb.MemberClaim(key=SIGNERS[1].public, signature=b"\0" * 256))
    assert not book.add(1, pb.MemberClaim(key=b"k" * 4096, signature=b"s"))  # bounded before it is parsed
    assert not book.add(5, sign(1, STMT))  # no such member
    assert book.add(1, sign(1, STMT)) and set(book.held) == {0, 1}
    assert set(book.members()) == {IDS[0], IDS[1]}
    assert full == [] and not book.add(2, sign(1, STMT)) and full == []
    assert book.add(2, sign(2, STMT)) and book.add(2, sign(2, STMT)) and full == [book]


def test_what_a_reducer_relays_adds_only_the_valid_claims_and_at_most_one_per_member():
    book = ClaimBook(STMT, IDS)
    forged = pb.MemberClaim(member=2, key=SIGNERS[0].public, signature=sign(0, STMT).signature)
    flood = [pb.MemberClaim(member=1, key=SIGNERS[1].public, signature=b"x")] * 1000
    book.relayed([forged, *flood])
    assert book.held == {}
    book.relayed([*ClaimBook(STMT, IDS, (2, sign(2, STMT))).wire()])
    assert set(book.held) == {2} and [c.member for c in book.wire()] == [2]


def _entries(book: ClaimBook, gid: bytes = GID, me: str = IDS[0]):
    return claim_entries(1, 7, gid, book, me)


def test_a_record_publishes_the_others_claims_and_a_member_of_two_groups_is_found():
    ours = ClaimBook(STMT, IDS, (0, sign(0, STMT)))
    for i in (1, 2):
        ours.add(i, sign(i, STMT))
    published = _entries(ours)
    assert [e[3] for e in published] == IDS[1:]  # (not our own: we are in one group)
    # member 2 also claimed another group of the round, whose member (not in ours) published it
    theirs = ClaimBook(statement(RUN, 1, 7, OTHER), ["x", IDS[2]], (1, sign(2, statement(RUN, 1, 7, OTHER))))
    found = _entries(theirs, OTHER, me="x")
    rec = [*published, *found]  # (what a peer publishes: lists, through msgpack as the DHT carries them)
    read = parse_entries(DHTProtocol.serializer.loads(DHTProtocol.serializer.dumps([list(e) for e in rec])))
    assert two_groups(read, RUN, 1, 7, GID, ours.members()) == {IDS[2]}
    assert two_groups(read, RUN, 1, 8, GID, ours.members()) == set()  # another round: no second group of ours
    assert two_groups(read, "run2", 1, 7, GID, ours.members()) == set()


@pytest.mark.parametrize("bad", ["gid", "signature", "peer"])
def test_an_entry_that_is_not_base64_or_not_signed_by_the_member_proves_nothing(bad):
    ours = ClaimBook(STMT, IDS, (0, sign(0, STMT)))
    ours.add(2, sign(2, STMT))
    entry = list(_entries(ClaimBook(statement(RUN, 1, 7, OTHER), ["x", IDS[2]],
                                    (1, sign(2, statement(RUN, 1, 7, OTHER)))), OTHER, me="x")[0])
    if bad == "gid":
        entry[2] = "not base64!"
    elif bad == "signature":
        entry[4] = base64.b64encode(sign(1, statement(RUN, 1, 7, OTHER)).signature).decode()
    else:
        entry[3] = IDS[1]  # member 1, whose claim for our group we do not hold
    assert two_groups([tuple(entry)], RUN, 1, 7, GID, ours.members()) == set()


def test_published_entries_are_bounded_and_at_their_bounds_fit_a_dht_value():
    longest = (1 << 40, 1 << 40, "g" * GROUP_ID_CHARS, "Q" * CLAIM_PEER_CHARS, "s" * SIGNATURE_CHARS)
    value = [list(longest)] * MAX_CLAIMS
    assert len(parse_entries(value)) == MAX_CLAIMS
    assert len(DHTProtocol.serializer.dumps(value)) + 1024 <= BOUNDS.max_value_bytes  # (+ the signature suffix)
    for bad in ([list(longest)] * (MAX_CLAIMS + 1), [[0, 0, "g", "Q", "s" * (SIGNATURE_CHARS + 1)]], [[-1, 0, "g",
                "Q", "s"]], [[0, 0, "g", "Q"]], {"a": 1}, "x", None):
        assert parse_entries(bad) == [], bad


def test_what_a_peer_published_is_read_by_the_others_and_outlives_it(tmp_path):
    """Through three DHT nodes with the run's validators: each witness reads back its own entries with the others';
    a value that is not a list of entries is refused by the nodes; and what a peer published is still read after its
    node is gone (claims are never withdrawn: the group that reads second must find them)."""
    keys = [RSAPrivateKey() for _ in range(3)]
    made = [make_validators(RUN, key) for key in keys]
    with dht_nodes(3, tmp_path, validators=lambda i: made[i][0]) as nodes:
        def witness(i):
            return Witness(nodes[i], run_key=RUN, subkey=made[i][1], peer_id=f"n{i}", horizon=60.0, timeout=20.0)

        a, b = witness(1), witness(2)
        mine = [(1, 7, base64.b64encode(GID).decode(), IDS[1], "c2ln")]
        theirs = [(1, 7, base64.b64encode(OTHER).decode(), IDS[2], "c2ln")]
        assert set(run_async(a.exchange(mine))) == set(mine)
        assert set(run_async(b.exchange(theirs))) == set(mine + theirs)
        assert not nodes[1].store(claims_key(RUN), {"junk": 1}, get_dht_time() + 30, subkey=made[1][1])
        shutdown_dht(nodes[1])
        assert set(run_async(b.exchange([]))) == set(mine + theirs)


def test_anyone_who_reads_both_claims_judges_them_once_per_round():
    """Any reader of the entries, in neither group, judges a member they show with valid claims for two groups of one
    round (against the key its record is signed with), once per round however often it reads them again; entries
    that are not the member's valid signatures, or of a member whose key we do not know, prove nothing."""
    def entry(i: int, gid: bytes, round_: int = 7, signer: int = -1) -> tuple:
        claim = sign(i if signer < 0 else signer, statement(RUN, 1, round_, gid))
        return 1, round_, base64.b64encode(gid).decode(), IDS[i], base64.b64encode(claim.signature).decode()

    keys = {IDS[i]: SIGNERS[i]._key.get_public_key() for i in (1, 2)}  # (member 0's key: unknown)
    read = [entry(1, GID), entry(1, OTHER), entry(2, GID), entry(2, OTHER, signer=1), entry(0, GID), entry(0, OTHER),
            entry(1, GID, round_=8), entry(2, OTHER, round_=8)]
    assert set(equivocations(read, RUN, keys.get)) == {(IDS[1], 1, 7)}
    witness = Witness(None, run_key=RUN, subkey=b"", peer_id=IDS[0], horizon=60.0, timeout=1.0)  # type: ignore
    verdicts = run_async(witness.judge(read, keys.get))
    assert [(v.peer, v.offence) for v in verdicts] == [(IDS[1], Offence.TWO_GROUPS)]
    exclusions = Exclusions(threshold=3)
    exclusions.apply(verdicts[0])
    assert IDS[1] in exclusions  # (a proof: an honest peer signs one claim per round, restarts included)
    assert "fragment 1 round 7" in verdicts[0].why
    assert run_async(witness.judge(read + [entry(2, GID, round_=8)], keys.get))[0].peer == IDS[2]  # (round 8: new)
    assert run_async(witness.judge(read, keys.get)) == []


def test_a_signer_signs_one_claim_per_round_also_after_a_restart(tmp_path):
    path = tmp_path / "claimed_rounds.json"
    key = RSAPrivateKey()
    signer = ClaimSigner(key, RUN, path)
    assert signer.claim((1, 7), STMT) is not None
    assert signer.claim((1, 7), statement(RUN, 1, 7, OTHER)) is None  # (another group of the same round: none)
    assert signer.claim((0, 7), statement(RUN, 0, 7, OTHER)) is not None
    restarted = ClaimSigner(key, RUN, path)  # (the rounds were written before the signatures existed)
    assert restarted.claim((1, 7), statement(RUN, 1, 7, OTHER)) is None and restarted.claim((1, 8), STMT) is not None
    assert ClaimSigner(key, "another run", path).claim((1, 7), STMT) is not None  # (another run's rounds: not ours)
    path.write_text("{not json")
    with pytest.raises(SetupError, match="claimed_rounds.json"):  # (one line, exit status 2: peer/errors.py)
        ClaimSigner(key, RUN, path)
