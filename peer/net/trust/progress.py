"""Signed progress records in the DHT: who is training this run, how far, how fast.

Each peer stores one record under ``{run_key}_progress`` with a subkey carrying its identity's RSA public key,
so only it can overwrite its record (hivemind's RSASignatureValidator); the value must be a
:class:`ProgressRecord` whose peer id is that key's hash (:func:`~peer.net.trust.auth.certifies`: records are
self-certifying, nobody speaks for another peer id), or every DHT node that validates rejects it. A record
expires after ``progress_ttl`` seconds, so a crashed peer stops counting as live on its own. :class:`LiveView`
merges what a peer reads into its view of who is live; :class:`SpeedLedger` remembers the speeds they claim
(the robust rule's caps).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import pydantic
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from peer.net.trust.auth import PassChecker, RunAccess, RunAuthorizer, certifies, owner_key, record_admitted
from peer.net.trust.claims import ClaimsValidator
from peer.net.trust.revocations import RevocationValidator
from peer.net.trust.records import ProgressRecord
from peer.net.trust.verdicts import RememberedSignatures, Verdicts



class ProgressValidator(RecordValidatorBase):
    """Accepts a record under the progress key only if its subkey carries an owner's public key
    (so the signature validator enforces ownership) and its value is a valid ProgressRecord of the peer id
    that key hashes to.

    hivemind's SchemaValidator and BytesWithPublicKey rely on pydantic-v1 internals that pydantic 2
    rejects, so this is the same rule written for pydantic 2. Other keys are not our business.
    """

    def __init__(self, run_key: Optional[str], checker: Optional[PassChecker] = None):
        """``checker``: in an authenticated run, a record must also carry its owner's valid pass. ``run_key``
        None (a bootstrap node, which serves any run): every record whose value names a ``peer_id`` is held to
        the rule, whatever its key (a node that stored what peers reject would make them drop its whole answer)."""
        self._key_id = None if run_key is None else DHTID.generate(source=progress_key(run_key)).to_bytes()
        self.checker = checker
        self._verdicts = Verdicts()  # (remembered only without a checker: a pass may expire or be revoked)

    def validate(self, record: DHTRecord) -> bool:
        if self._key_id is not None and record.key != self._key_id:
            return True
        return self._check(record) if self.checker is not None else self._verdicts.check(record, self._check)

    def _check(self, record: DHTRecord) -> bool:
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
            if self._key_id is None and not (isinstance(value, dict) and "peer_id" in value):
                return True
            if not isinstance(subkey, bytes) or owner_key(subkey) is None:
                return False
            if value is None:  # a withdrawal (the signature validator checks it is the owner's)
                return True
            rec = ProgressRecord.from_wire(value)
            if not certifies(subkey, rec.peer_id):
                return False
            return self.checker is None or record_admitted(self.checker, subkey, rec.pass_line, rec.peer_id)
        except (ValueError, TypeError, pydantic.ValidationError, Exception):
            return False


def node_validators() -> list[RecordValidatorBase]:
    """A bootstrap node's record validators (it serves any run): owners' signatures, and progress records
    that speak only for their signer's peer id."""
    return [ProgressValidator(None), RememberedSignatures()]


def make_validators(run_key: str, private_key: Optional[RSAPrivateKey] = None,
                    checker: Optional[PassChecker] = None) -> tuple[list[RecordValidatorBase], bytes]:
    """Record validators for the DHT and the subkey under which this process signs its record.

    ``private_key`` signs our record: the identity's key (its hash is our peer id, which the record names);
    None only for a node that publishes no record (the monitor, a bootstrap node: this process's key).
    ``checker``: the run's pass checker in an authenticated run (records must carry their owner's pass;
    revocation lists must be the authority's).
    Must be created before the DHT process is started (validators are handed to it).
    """
    signer = RememberedSignatures(private_key)
    validators: list[RecordValidatorBase] = [ProgressValidator(run_key, checker), signer, ClaimsValidator(run_key)]
    if checker is not None:
        validators.append(RevocationValidator(checker))
    return validators, signer.local_public_key


def dht_security(run_key: str, access: Optional[RunAccess],
                 key: Optional[RSAPrivateKey] = None) -> tuple[list[RecordValidatorBase], bytes, dict]:
    """What a DHT node of a run needs: the record validators, the subkey our record is signed under, and the
    ``create_dht`` options (in an authenticated run, the authorizer that carries our pass; ``access`` None: an
    open run). ``key``: the identity key our record is signed with (an authenticated run's is ``access.key``;
    None: we publish no record). Must be called before the DHT process starts."""
    signer = access.key if access else key
    validators, subkey = make_validators(run_key, signer, access.checker if access else None)
    auth = {} if access is None else {"authorizer": RunAuthorizer(access.key, access.token, access.checker)}
    return validators, subkey, auth


def progress_key(run_key: str) -> str:
    return f"{run_key}_progress"


class LiveView:
    """The other peers' progress records, merged from successive DHT reads: a failure detector.

    Liveness is judged by *arrival*: a peer is live for ``ttl`` seconds after we last received a newer
    record of it (a larger ``time``), not ``ttl`` after its owner wrote it. While a DHT node is unreachable,
    every store and get waits for it (up to the DHT's RPC timeout), so records arrive late; judged by their
    age they would expire although their owners keep publishing, and a healthy swarm would see itself alone.
    A read that fails or misses a peer's record forgets nothing; the record ages out on its own. A record
    the DHT already expired is never accepted (the DHT keeps a record ``ttl`` after its owner wrote it), and
    a record withdrawn by its owner (value None under its subkey, at a clean stop) drops that peer at once.

    :meth:`merge` and :meth:`live` may run in different threads: ``merge`` swaps in a new dict.
    """

    def __init__(self, ttl: float):
        self.ttl = ttl
        # peer id -> (subkey of its record, the record, our local monotonic time when it arrived)
        self._peers: dict[str, tuple[bytes, ProgressRecord, float]] = {}

    def merge(self, found, *, dht_now: float, local_now: float,
              accept: Optional[Callable[[bytes, ProgressRecord], bool]] = None) -> None:
        """Adds the records of a ``dht.get(progress_key, latest=True)`` result (None: nothing found).

        ``dht_now`` is the DHT clock (``get_dht_time()``), ``local_now`` our monotonic clock; ``accept``
        (subkey, record) -> whether the record may be acted on (authenticated runs: its pass; default all).
        """
        if found is None or not isinstance(found.value, dict):
            return
        peers = dict(self._peers)
        for subkey, entry in found.value.items():
            if entry.value is None:  # withdrawn by its owner: forget the peer if that was its current record
                peers = {pid: v for pid, v in peers.items() if v[0] != subkey}
                continue
            if entry.expiration_time < dht_now:
                continue
            try:
                rec = ProgressRecord.from_wire(entry.value)
            except ValueError:  # (pydantic.ValidationError is one)
                continue
            if accept is not None and not (isinstance(subkey, bytes) and accept(subkey, rec)):
                continue
            known = peers.get(rec.peer_id)
            if known is None or rec.time > known[1].time:
                peers[rec.peer_id] = (subkey, rec, local_now)
        self._peers = {pid: v for pid, v in peers.items() if v[2] + self.ttl >= local_now}

    def owner(self, peer: str) -> Optional[bytes]:
        """The public key (OpenSSH form) that signed ``peer``'s newest record we hold, or None."""
        held = self._peers.get(peer)
        return None if held is None else owner_key(held[0])

    def live(self, local_now: float) -> dict[str, ProgressRecord]:
        """Records of the peers whose newest record arrived within ``ttl`` of ``local_now``."""
        return {pid: rec for pid, (_, rec, arrived) in self._peers.items() if arrived + self.ttl >= local_now}


VOUCH_WINDOW = 60.0  # seconds of records a peer's speed is judged on (the robust rule's caps, aggregate.vouched_caps)
MAX_RATES = 256  # rates remembered per peer (one per heartbeat read: a minute at the fastest progress_period)


class SpeedLedger:
    """What the progress records vouch for about each peer's speed (tokens/s): the lowest rate its records
    claimed over the last ``window`` seconds, once we have heard from it for that long.

    A record is self-declared: this only makes a claim cost time. A newcomer (or a sybil's fresh id) is
    unvouched for ``window`` seconds, and one fast record among slower ones does not count. What a peer that
    lies steadily gains is bounded by the rule's ``max_weight_cap``. Used from one thread (the heartbeat's).
    """

    def __init__(self, window: float = VOUCH_WINDOW):
        self.window = window
        self._seen: dict[str, tuple[float, list[tuple[float, float]]]] = {}  # peer -> (first heard, [(at, rate)])

    def observe(self, records: Mapping[str, ProgressRecord], now: float) -> None:
        """Adds the rates of ``records`` (the live ones; ``now``: local monotonic time). A peer missing from
        them is forgotten: when it comes back it is a newcomer again."""
        seen = {}
        for pid, rec in records.items():
            first, rates = self._seen.get(pid, (now, []))
            rates = [(t, r) for t, r in rates if t + self.window >= now][-(MAX_RATES - 1):]
            seen[pid] = (first, [*rates, (now, rec.tokens_per_second)])
        self._seen = seen

    def vouched(self, peer: str, now: float) -> Optional[float]:
        """The speed ``peer``'s records vouch for at ``now``, or None (unknown, or heard from for less than
        ``window``)."""
        first, rates = self._seen.get(peer, (now, []))
        recent = [r for t, r in rates if t + self.window >= now]
        return min(recent) if now - first >= self.window and recent else None
