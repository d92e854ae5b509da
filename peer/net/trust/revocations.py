"""Revocations in an authenticated run: the run authority's signed list of the peer ids whose passes it revoked
(docs/architecture.md, "Hostile peers").

The list lives under one DHT key per authority (:func:`revocation_key`); bootstrap nodes publish it
(:func:`sign_revocations`), and the run's DHT nodes store under that key only lists the authority signed
(:class:`RevocationValidator`). Every peer reads it with its heartbeat and applies what verifies
(:func:`verify_revocations`) to its :class:`~peer.net.trust.auth.Admission` (:func:`revoke_listed`) and to the
pass checkers of its DHT process (:func:`revoke_in_dht`). A revocation is never taken back. What is read from the
wire is bounded and checked before the signature is: at most ``MAX_REVOKED`` well-formed peer ids.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from peer.net.plumbing.hivemind_internals import request_and_record_checkers
from peer.net.trust.auth import Admission, PassChecker, fingerprint, parse_public_key
from peer.net.trust.records import PEER_ID

MAX_REVOKED = 10_000  # peer ids in one revocation list


def revocation_key(authority: str | bytes) -> str:
    """The DHT key of an authority's revocation list (derived from its public key: one per authority)."""
    return "swarmloco_revoked_" + fingerprint(authority)


def sign_revocations(authority: RSAPrivateKey, peer_ids: Iterable[str], issued: float) -> dict[str, Any]:
    """The wire form of a revocation list (a msgpack-able dict)."""
    ids = sorted(set(peer_ids))
    payload = "\n".join(["swarmloco-revoked/1", repr(float(issued)), *ids]).encode()
    return {"revoked": ids, "issued": float(issued), "signature": authority.sign(payload)}


def verify_revocations(checker: PassChecker, value: Any) -> Optional[frozenset[str]]:
    """The peer ids of a revocation list read from the DHT if the authority signed it, else None."""
    if not isinstance(value, dict) or set(value) != {"revoked", "issued", "signature"}:
        return None
    ids, issued, signature = value["revoked"], value["issued"], value["signature"]
    if (not isinstance(ids, list) or len(ids) > MAX_REVOKED or not isinstance(issued, float)
            or not isinstance(signature, bytes) or not all(isinstance(i, str) and PEER_ID.fullmatch(i) for i in ids)):
        return None
    payload = "\n".join(["swarmloco-revoked/1", repr(issued), *ids]).encode()
    return frozenset(ids) if parse_public_key(checker.authority_bytes).verify(payload, signature) else None


class RevocationValidator(RecordValidatorBase):
    """DHT nodes of an authenticated run store under the revocation key only lists the authority signed."""

    def __init__(self, checker: PassChecker):
        self.checker = checker
        self._key_id = DHTID.generate(source=revocation_key(checker.authority_bytes)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        try:
            return verify_revocations(self.checker, DHTProtocol.serializer.loads(record.value)) is not None
        except Exception:  # a value that does not even deserialize
            return False


async def revoke_in_dht(peer_ids: frozenset, dht, node) -> int:
    """Runs in a DHT process (``dht.run_coroutine(functools.partial(revoke_in_dht, ids))``): adds ``peer_ids`` to
    the revoked ones of every pass checker there (the authorizer's, which checks every DHT request and response,
    and the record validators'). The process got its checkers when it forked; without this a revoked pass
    still passed its DHT request checks until it expired. Returns how many checkers it updated."""
    authorizer, *validators = request_and_record_checkers(node)
    checkers = [getattr(authorizer, "_checker", None)] + [getattr(v, "checker", None) for v in validators]
    found = {id(c): c for c in checkers if isinstance(c, PassChecker)}
    for checker in found.values():
        checker.revoked = checker.revoked | frozenset(peer_ids)
    return len(found)


def revoke_listed(admission: Admission, value: Any) -> set[str]:
    """Revokes in ``admission`` the peers named by a revocation list (a DHT entry's value) the run authority signed;
    returns the ones that are new (none for a list that does not verify, or in an open run)."""
    if admission.checker is None:
        return set()
    return admission.revoke(verify_revocations(admission.checker, value) or ())
