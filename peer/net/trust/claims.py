"""Member claims: one group per member per round, or the proof of two (no network; the signer keeps a file).

A member counted in two groups of one round lets both apply (docs/architecture.md, "One digest for every applied
round"). So each member signs, with its identity's RSA key (the peer id is its hash), a claim that it is in group
``gid`` of round ``(fragment, round)`` of the run (:class:`ClaimSigner`), sends it to every reducer with its part,
and each reducer relays the claims it holds with its list of spans. A member counts toward its quorum only the
members whose claim for its group it holds (:class:`ClaimBook`). Before applying, every member publishes the claims
it holds under the run's claims key, then reads everyone's (:mod:`peer.net.witness`; :func:`claim_entries`,
:func:`two_groups`): a member with a valid claim for another group of the round is not counted. Of two groups that
share a member, whichever reads second sees the other's claim, so at most one of them applies. An honest peer
never signs two claims for one round, also across restarts (:class:`ClaimSigner` records the rounds it signed,
before it signs, and signs none twice), so two are a proof.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import struct
import threading
from pathlib import Path
from typing import Annotated, Callable, Iterable, Mapping, Optional

import pydantic
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import Field, StrictStr

from peer.errors import SetupError
from peer.net.trust.auth import owner_key, parse_public_key, peer_id_of, write_private
from peer.net.trust.records import Count
from peer.net.trust.verdicts import Verdicts
from peer.proto import allreduce_pb2 as pb

_DOMAIN = b"swarmloco claim v1\0"
# what a claim may hold: a key in OpenSSH form (RSA-2048: ~380 bytes) and a signature (an RSA-4096 key's: 512 bytes)
MAX_KEY_BYTES, MAX_SIGNATURE_BYTES = 1024, 512
# a published entry: a group id (hivemind's: 20 bytes, 28 characters) and a signature in base64, a peer id that is an
# RSA key's ("Qm...", 46 characters); at most MAX_CLAIMS entries per peer (~53 KB at these bounds: a DHT value)
GROUP_ID_CHARS, SIGNATURE_CHARS, CLAIM_PEER_CHARS, MAX_CLAIMS = 64, 684, 64, 64
MAX_SIGNED_ROUNDS = 4096  # rounds a signer remembers having signed (a restart reruns at most a few recent ones)


def statement(run_key: str, fragment: int, round_: int, group_id: bytes) -> bytes:
    """What a claim signs: the run, the fragment and round, and the group."""
    run = run_key.encode()
    return _DOMAIN + struct.pack(">I", len(run)) + run + struct.pack(">QQI", fragment, round_, len(group_id)) + group_id


class ClaimSigner:
    """Signs this peer's claims of run ``run_key`` with its identity key (the key whose hash is our peer id), at most
    one per (fragment, round): a round we signed before, in this process or (``signed_path``: where the rounds are
    kept, written atomically before each signature) before a restart, gets none. :meth:`claim` may be called from
    any thread."""

    def __init__(self, key: RSAPrivateKey, run_key: str, signed_path: Optional[str | Path] = None):
        self._key, self._run = key, run_key
        self.public = key.get_public_key().to_bytes()
        self._path = None if signed_path is None else Path(signed_path)
        self._signed: dict[tuple[int, int], None] = {}  # (fragment, round) of this run, oldest first
        self._lock = threading.Lock()
        if self._path is not None and self._path.exists():
            try:
                saved = json.loads(self._path.read_text())
                if saved["run"] == run_key:  # (another run's rounds say nothing of this one's)
                    self._signed = {(int(f), int(r)): None for f, r in saved["rounds"]}
            except (ValueError, TypeError, KeyError, OSError) as e:
                raise SetupError(f"{self._path}: unreadable list of the rounds this identity signed ({e}); move "
                                 f"it away only if no other process of this identity runs") from None

    def claim(self, here: tuple[int, int], stmt: bytes) -> Optional[pb.MemberClaim]:
        """Our claim of ``stmt``, the statement of a group of round ``here`` (fragment, round); None if we signed
        one for that round already. The round is recorded (and persisted: a disk write) before the signature
        exists."""
        with self._lock:
            if here in self._signed:
                return None
            self._signed[here] = None
            while len(self._signed) > MAX_SIGNED_ROUNDS:
                del self._signed[next(iter(self._signed))]
            if self._path is not None:
                saved = {"run": self._run, "rounds": [list(k) for k in self._signed]}
                write_private(self._path, json.dumps(saved).encode())
        return pb.MemberClaim(key=self.public, signature=self._key.sign(stmt))


@functools.lru_cache(maxsize=1024)
def _key_of(key: bytes, peer_id: str) -> Optional[RSAPublicKey]:
    """``key`` parsed, if it is the one ``peer_id`` is the hash of (cached: a member's key arrives once per reducer)."""
    try:
        parsed = parse_public_key(key)
        return parsed if peer_id_of(parsed) == peer_id else None
    except ValueError:
        return None


def key_of(claim: pb.MemberClaim, peer_id: str) -> Optional[RSAPublicKey]:
    """The claim's key if it is ``peer_id``'s (bounded before it is parsed), else None."""
    return peer_key(bytes(claim.key), peer_id)


def peer_key(key: bytes, peer_id: str) -> Optional[RSAPublicKey]:
    """``key`` (OpenSSH form; bounded before it is parsed) if it is the one ``peer_id`` is the hash of, else None."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        return None
    return _key_of(key, peer_id)


def signed(key: RSAPublicKey, stmt: bytes, signature: bytes) -> bool:
    """Whether ``signature`` (bounded) is ``key``'s of ``stmt``."""
    if not 0 < len(signature) <= MAX_SIGNATURE_BYTES:
        return False
    try:
        return key.verify(stmt, signature)
    except Exception:  # (cryptography raises on malformed signatures)
        return False


class ClaimBook:
    """The claims of one group's members for that group, each checked as it arrives (member index -> claim).
    One per member side of a round; written on the event loop that runs it, by :meth:`add` only. ``on_full`` is
    called once, from the :meth:`add` that makes the book hold every member's claim (the round's witness can then
    run while its all-reduce does: :mod:`peer.net.round.round_runner`)."""

    def __init__(self, stmt: bytes, peer_ids: Iterable[object], own: Optional[tuple[int, pb.MemberClaim]] = None,
                 on_full: Optional[Callable[["ClaimBook"], None]] = None):
        self.stmt, self.peer_ids = stmt, [str(p) for p in peer_ids]
        self.held: dict[int, pb.MemberClaim] = {}
        self._on_full = on_full
        if own is not None:
            self.add(*own)

    def add(self, member: int, claim: pb.MemberClaim) -> bool:
        """Keeps ``claim`` as member ``member``'s if it is its key's valid signature of this group's statement."""
        if member in self.held:
            return True
        if not 0 <= member < len(self.peer_ids) or len(self.peer_ids[member]) > CLAIM_PEER_CHARS:
            return False  # (a claim no record can publish is not counted: nobody could see it twice)
        key = key_of(claim, self.peer_ids[member])
        if key is None or not signed(key, self.stmt, bytes(claim.signature)):
            return False
        self.held[member] = pb.MemberClaim(member=member, key=claim.key, signature=claim.signature)
        if len(self.held) == len(self.peer_ids) and (full := self._on_full) is not None:
            self._on_full = None
            full(self)
        return True

    def relayed(self, claims: Iterable[pb.MemberClaim]) -> None:
        """Adds the valid ones of what a reducer relayed (at most one per member of the group)."""
        for claim in list(claims)[:len(self.peer_ids)]:
            self.add(claim.member, claim)

    def wire(self) -> list[pb.MemberClaim]:
        return [self.held[i] for i in sorted(self.held)]

    def members(self) -> dict[str, RSAPublicKey]:
        """Peer id -> key of every member whose claim we hold."""
        out = {}
        for i, claim in self.held.items():
            key = key_of(claim, self.peer_ids[i])
            if key is not None:
                out[self.peer_ids[i]] = key
        return out


Entry = tuple[int, int, str, str, str]  # (fragment, round, group id, peer id, signature), base64 for the bytes
_ENTRIES = pydantic.TypeAdapter(Annotated[
    list[tuple[Count, Count, Annotated[StrictStr, Field(max_length=GROUP_ID_CHARS)],
               Annotated[StrictStr, Field(max_length=CLAIM_PEER_CHARS)],
               Annotated[StrictStr, Field(max_length=SIGNATURE_CHARS)]]],
    Field(max_length=MAX_CLAIMS)])


def claims_key(run_key: str) -> str:
    """The DHT key under which each peer publishes its recent claims entries (its subkey: its owner key)."""
    return f"{run_key}_claims"


def parse_entries(value: object) -> list[Entry]:
    """A peer's published entries, checked strictly (they come from anyone); [] if malformed."""
    try:
        return [tuple(e) for e in _ENTRIES.validate_python(value)]  # type: ignore[misc]
    except (pydantic.ValidationError, TypeError, ValueError):
        return []


class ClaimsValidator(RecordValidatorBase):
    """Accepts a value under the run's claims key only under a subkey that names its owner's key (so the signature
    validator enforces ownership), and only a list of entries :func:`parse_entries` accepts. Other keys pass."""

    def __init__(self, run_key: str):
        self._key_id = DHTID.generate(source=claims_key(run_key)).to_bytes()
        self._verdicts = Verdicts()

    def validate(self, record: DHTRecord) -> bool:
        return record.key != self._key_id or self._verdicts.check(record, self._check)

    def _check(self, record: DHTRecord) -> bool:
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
            if not isinstance(subkey, bytes) or owner_key(subkey) is None:
                return False
            return isinstance(value, list) and len(parse_entries(value)) == len(value)
        except Exception:
            return False


def claim_entries(fragment: int, round_: int, group_id: bytes, book: ClaimBook, me: str) -> list[Entry]:
    """The entries we publish for one group of ours: the claims of its other members."""
    gid = base64.b64encode(group_id).decode()
    return [(fragment, round_, gid, book.peer_ids[i], base64.b64encode(c.signature).decode())
            for i, c in sorted(book.held.items()) if book.peer_ids[i] != me]


def equivocations(entries: Iterable[Entry], run_key: str, key_of: Callable[[str], Optional[RSAPublicKey]]
                  ) -> dict[tuple[str, int, int], tuple[str, str]]:
    """Every (peer, fragment, round) that ``entries`` (anyone's) show with valid claims for two groups, with the two
    group ids: checked against the key ``key_of(peer)`` gives (None: unknown, skipped), at most one check per distinct
    entry (run it off the event loop: see :func:`two_groups`)."""
    gids: dict[tuple[str, int, int], dict[str, set[str]]] = {}
    for f, r, gid, pid, sig in set(entries):
        gids.setdefault((pid, f, r), {}).setdefault(gid, set()).add(sig)
    found = {}
    for (pid, f, r), claimed in gids.items():
        if len(claimed) < 2 or (key := key_of(pid)) is None:
            continue
        valid = [gid for gid, sigs in claimed.items() if any(_signed_entry(key, run_key, f, r, gid, s) for s in sigs)]
        if len(valid) >= 2:
            found[(pid, f, r)] = (valid[0], valid[1])
    return found


def _signed_entry(key: RSAPublicKey, run_key: str, fragment: int, round_: int, gid: str, sig: str) -> bool:
    """Whether the entry's signature (base64) is ``key``'s of the claim for group ``gid`` (base64)."""
    try:
        group, signature = base64.b64decode(gid, validate=True), base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        return False
    return signed(key, statement(run_key, fragment, round_, group), signature)


def two_groups(entries: Iterable[Entry], run_key: str, fragment: int, round_: int, group_id: bytes,
               keys: Mapping[str, RSAPublicKey]) -> set[str]:
    """Of the members ``keys`` names (peer id -> the key of its claim for our group), those a published entry shows
    with a valid claim for another group of the same round. ``entries`` may come from anyone: each is checked
    against the key we hold (at most one check per distinct entry; a key's worth of made-up entries, ~10k, is about
    half a second of checks: run it off the event loop)."""
    ours = base64.b64encode(group_id).decode()
    found: set[str] = set()
    for f, r, gid, pid, sig in set(entries):
        if f != fragment or r != round_ or gid == ours or pid not in keys or pid in found:
            continue
        if _signed_entry(keys[pid], run_key, fragment, round_, gid, sig):
            found.add(pid)
    return found
