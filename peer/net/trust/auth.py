"""Authenticated runs: an operator's run authority admits volunteers by peer id (docs/architecture.md, "Hostile
peers").

An open run (``swarm.authority`` empty) admits anyone and says so at start. In an authenticated run,
``swarm.authority`` is the public half of the operator's RSA authority key (so it is in the run hash), and:

- A volunteer's **pass** (hivemind's ``AccessToken``, :func:`issue_pass`, :class:`PassChecker`) is signed by the
  authority and names a peer id, the RSA key that id is the hash of (it signs transport, DHT requests, records)
  and an expiry, so no other peer can use it.
- **Checked** at every DHT request and response (:class:`RunAuthorizer`), every progress record
  (:func:`record_admitted`), every stream our handlers serve (``streams.StreamGuard`` asks :class:`Admission`),
  every group we average in and every state donor. Everything read from the wire is bounded and checked first.
- **Revocations**: the authority's signed list, published by bootstrap nodes and applied by :class:`Admission`
  and in the DHT process (:mod:`peer.net.trust.revocations`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import re
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from google.protobuf.message import DecodeError
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from peer.net.plumbing.hivemind_internals import private_key_from_der, public_key_der
from peer.net.trust.records import MAX_PASS_CHARS, PEER_ID, ProgressRecord

PASS_PREFIX = "swarmloco-pass:"
REQUEST_PREFIX = "swarmloco-request:"
MAX_PASSES = 4096  # passes an Admission remembers (the newest)
_OWNER_KEY = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX, re.DOTALL)


# ---- keys ------------------------------------------------------------------------------------
def identity_key(identity_path: str | Path) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (``addresses.ensure_identity`` wrote it): the peer id is its hash."""
    return private_key_from_der(crypto_pb2.PrivateKey.FromString(Path(identity_path).read_bytes()).data)


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: the multihash of its protobuf encoding."""
    from hivemind.p2p import PeerID

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der(public_key)).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()  # multihash: sha2-256, 32 bytes


@functools.lru_cache(maxsize=1024)
def certifies(subkey: bytes, peer_id: str) -> bool:
    """Whether a DHT record signed under ``subkey`` may speak for ``peer_id``: the RSA key its subkey names (the
    key hivemind's signature validator checks the record against) is the one ``peer_id`` is the hash of. Records
    are self-certifying, as libp2p's peer records are: nobody can publish under another peer's id."""
    owner = owner_key(subkey)
    if owner is None:
        return False
    try:
        return peer_id_of(parse_public_key(owner)) == peer_id
    except ValueError:
        return False


def fingerprint(public_key: str | bytes) -> str:
    """A short name of a public key for logs (the first 16 hex digits of the SHA-256 of its OpenSSH form)."""
    return hashlib.sha256(parse_public_key(public_key).to_bytes()).hexdigest()[:16]


def parse_public_key(text: str | bytes) -> RSAPublicKey:
    """An ``ssh-rsa AAAA...`` line. Raises ValueError."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > MAX_PASS_CHARS:
        raise ValueError("public key too long")
    try:
        return RSAPublicKey.from_bytes(raw.strip())
    except Exception as e:  # cryptography raises ValueError or UnsupportedAlgorithm
        raise ValueError(f"not an RSA public key in OpenSSH format ({type(e).__name__})") from None


def write_private(path: Path, data: bytes) -> None:
    """Writes a secret atomically (temp file, fsync, rename) with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- passes ----------------------------------------------------------------------------------
def _signed_part(token: AccessToken) -> bytes:
    return b"\0".join([b"swarmloco-pass/1", token.username.encode(), token.public_key,
                       token.expiration_time.encode()])


def issue_pass(authority: RSAPrivateKey, public_key: RSAPublicKey, valid_for: timedelta,
               now: Optional[datetime] = None) -> AccessToken:
    """A pass for the peer whose identity key is ``public_key``, valid for ``valid_for`` from ``now``."""
    expires = (now or datetime.now(timezone.utc)) + valid_for
    token = AccessToken(username=peer_id_of(public_key), public_key=public_key.to_bytes(),
                        expiration_time=expires.astimezone(timezone.utc).isoformat(timespec="seconds"))
    token.signature = authority.sign(_signed_part(token))
    return token


def encode_pass(token: AccessToken) -> str:
    return PASS_PREFIX + base64.b64encode(token.SerializeToString()).decode()


def decode_pass(text: str) -> AccessToken:
    """A pass line (``swarmloco-pass:...``). Raises ValueError; says nothing of its validity."""
    text = text.strip()
    if len(text) > MAX_PASS_CHARS or not text.startswith(PASS_PREFIX):
        raise ValueError(f"not a pass line (it starts with {PASS_PREFIX!r} and is at most {MAX_PASS_CHARS} chars)")
    try:
        return AccessToken.FromString(base64.b64decode(text[len(PASS_PREFIX):], validate=True))
    except (binascii.Error, DecodeError, ValueError):
        raise ValueError("the pass line is damaged (it does not decode)") from None


def pass_request(key: RSAPrivateKey) -> str:
    """The line a volunteer sends the operator: its peer id and identity public key."""
    pub = key.get_public_key()
    return f"{REQUEST_PREFIX}{peer_id_of(pub)}:{base64.b64encode(pub.to_bytes()).decode()}"


def parse_pass_request(text: str) -> RSAPublicKey:
    """The public key of a pass request line, checked against the peer id it names. Raises ValueError."""
    text = text.strip()
    parts = text[len(REQUEST_PREFIX):].split(":") if text.startswith(REQUEST_PREFIX) else []
    if len(text) > MAX_PASS_CHARS or len(parts) != 2:
        raise ValueError(f"not a pass request line ({REQUEST_PREFIX}PEER_ID:KEY, from swarm-peer pass-request)")
    try:
        key = parse_public_key(base64.b64decode(parts[1], validate=True))
    except (binascii.Error, ValueError):
        raise ValueError("the pass request is damaged (its key does not decode)") from None
    if peer_id_of(key) != parts[0]:
        raise ValueError("the pass request's peer id is not its key's")
    return key


class PassChecker:
    """Checks passes against one authority's public key. Picklable (the DHT process gets a copy)."""

    def __init__(self, authority: str | bytes, revoked: Iterable[str] = ()):
        self.authority_bytes = parse_public_key(authority).to_bytes()
        self.revoked = frozenset(revoked)
        self._key: Optional[RSAPublicKey] = None
        self._verified: dict[bytes, bool] = {}  # signed part + signature -> verdict (RSA checks cost ~0.1 ms)

    def __getstate__(self) -> dict[str, Any]:
        return {"authority_bytes": self.authority_bytes, "revoked": self.revoked}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["authority_bytes"], state["revoked"])  # type: ignore[misc]

    def why_invalid(self, token: AccessToken, now: Optional[float] = None) -> Optional[str]:
        """Why ``token`` is no valid pass of this run at ``now`` (unix seconds), or None."""
        if not PEER_ID.fullmatch(token.username):
            return "its peer id is malformed"
        try:
            key = parse_public_key(token.public_key)
            expires = datetime.fromisoformat(token.expiration_time)
        except ValueError:
            return "its key or expiry is malformed"
        if expires.tzinfo is None:
            return "its expiry has no time zone"
        if peer_id_of(key) != token.username:
            return "its peer id is not its key's"
        if expires.timestamp() <= (time.time() if now is None else now):
            return f"it expired at {token.expiration_time}"
        if token.username in self.revoked:
            return "the authority revoked it"
        signed = _signed_part(token) + b"\0" + token.signature
        if signed not in self._verified:
            if self._key is None:
                self._key = parse_public_key(self.authority_bytes)
            if len(self._verified) >= MAX_PASSES:
                self._verified.clear()
            self._verified[signed] = self._key.verify(_signed_part(token), token.signature)
        return None if self._verified[signed] else "it is not signed by this run's authority"

    def valid(self, token: AccessToken, now: Optional[float] = None) -> bool:
        return self.why_invalid(token, now) is None


def owner_key(subkey: bytes) -> Optional[bytes]:
    """The public key an RSA-signed DHT subkey names (hivemind's ``[owner:...]``), or None."""
    found = _OWNER_KEY.search(subkey)
    return found.group(1) if found else None


def record_admitted(checker: PassChecker, subkey: bytes, pass_line: str, peer_id: str) -> bool:
    """Whether a progress record may be acted on in an authenticated run: it carries a valid pass for the
    peer id it claims, bound to the key that signed the record (its subkey's owner)."""
    try:
        token = decode_pass(pass_line)
    except ValueError:
        return False
    return checker.valid(token) and token.username == peer_id and owner_key(subkey) == token.public_key


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's token authorizer with our pass as the token: DHT requests and responses of peers without a
    valid pass are dropped. A pass is not refreshed: when it expires the peer must get a new one."""

    def __init__(self, key: RSAPrivateKey, token: AccessToken, checker: PassChecker):
        super().__init__(key)
        self._token, self._checker = token, checker

    async def get_token(self) -> AccessToken:
        return self._token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self._checker.valid(access_token)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


class Admission:
    """Which remote peer ids may take part. Everyone in an open run (``checker`` None); in an authenticated
    run, the ids whose valid pass we hold (from their progress records, or our own) and whose pass the
    authority has not revoked. Used from the networking thread's event loop."""

    def __init__(self, checker: Optional[PassChecker]):
        self.checker = checker
        self._passes: dict[str, float] = {}  # peer id -> when its pass expires (unix seconds)
        self.revoked: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return self.checker is None

    def learn(self, token: AccessToken) -> bool:
        """Remembers a pass if it is valid; returns whether it was."""
        if self.checker is None or not self.checker.valid(token) or token.username in self.revoked:
            return False
        if token.username not in self._passes and len(self._passes) >= MAX_PASSES:
            self._passes.pop(min(self._passes, key=self._passes.__getitem__))
        self._passes[token.username] = datetime.fromisoformat(token.expiration_time).timestamp()
        return True

    def accept_record(self, subkey: bytes, rec: ProgressRecord) -> bool:
        """Whether a progress record may be acted on (:func:`record_admitted`, not revoked); remembers its
        pass. Every record in an open run."""
        if self.checker is None:
            return True
        if rec.peer_id in self.revoked or not record_admitted(self.checker, subkey, rec.pass_line, rec.peer_id):
            return False
        return self.learn(decode_pass(rec.pass_line))

    def revoke(self, peer_ids: Iterable[str]) -> set[str]:
        """Adds ``peer_ids`` to the revoked ones (never removed); returns the ones that are new."""
        new = set(peer_ids) - self.revoked
        self.revoked = self.revoked | new
        for pid in new:
            self._passes.pop(pid, None)
        return new

    def admitted(self, peer_id: str) -> bool:
        if self.checker is None:
            return True
        expires = self._passes.get(peer_id)
        return expires is not None and expires > time.time() and peer_id not in self.revoked


@dataclass(frozen=True)
class RunAccess:
    """This peer's credentials in an authenticated run: the run's checker, our pass, our identity's key."""

    checker: PassChecker
    token: AccessToken
    key: RSAPrivateKey

    @functools.cached_property
    def expires_at(self) -> float:
        """When our pass expires (unix seconds)."""
        return datetime.fromisoformat(self.token.expiration_time).timestamp()

    def why_ended(self, me: str, admission: Admission) -> Optional[str]:
        """Why our own pass no longer admits us (the authority revoked it, or it expired), or None. Then no peer
        of the run works with us."""
        if me in admission.revoked:
            return "the run authority revoked this peer's pass"
        if time.time() >= self.expires_at:
            return f"this peer's pass expired at {self.token.expiration_time}"
        return None

    @classmethod
    def load(cls, authority: str, pass_path: str | Path, identity_path: str | Path) -> "RunAccess":
        """Reads and checks our pass for the run of ``authority`` (must be called after the identity exists).
        Raises ValueError with one line naming the setting to fix."""
        try:
            checker = PassChecker(authority)
        except ValueError as e:
            raise ValueError(f"swarm.authority: {e} (paste the line swarm-bootstrap authority init printed)") from None
        path = Path(pass_path)
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_PASS_CHARS + 1).decode("ascii", errors="replace")
        except OSError as e:
            raise ValueError(f"swarm.pass_path: this run admits only peers with a pass, and {str(path)!r} cannot be "
                             f"read ({e.strerror}); send the operator the line of `swarm-peer pass-request` and "
                             f"save the pass they return there") from None
        try:
            token = decode_pass(text)
        except ValueError as e:
            raise ValueError(f"swarm.pass_path: {str(path)!r}: {e}") from None
        why = checker.why_invalid(token)
        if why is not None:
            raise ValueError(f"swarm.pass_path: the pass in {str(path)!r} is not valid for this run: {why}")
        key = identity_key(identity_path)
        mine = peer_id_of(key.get_public_key())
        if token.username != mine:
            raise ValueError(f"swarm.pass_path: the pass in {str(path)!r} is for peer {token.username}, this peer is "
                             f"{mine} (identity {str(identity_path)!r})")
        return cls(checker, token, key)
