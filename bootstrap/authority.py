"""``swarm-bootstrap authority``: an operator's run authority (peer/net/trust/auth.py has the mechanism).

    swarm-bootstrap authority init DIR                  # a new authority: DIR/authority.key (secret), .pub
    swarm-bootstrap authority issue DIR REQUEST [--days N]   # prints a pass for a volunteer's request line
    swarm-bootstrap authority revoke DIR PEER_ID ...    # adds peer ids to DIR/revoked.txt

A bootstrap node started with ``--authority DIR`` serves only peers with a pass (its own is issued at start)
and publishes DIR/revoked.txt, signed, in the DHT every ``--refresh-period``, so peers stop admitting the
revoked ones. Every error is one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

KEY, PUB, REVOKED = "authority.key", "authority.pub", "revoked.txt"
DEFAULT_DAYS = 30.0


class AuthorityError(Exception):
    """Bad input to an authority command: one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    from bootstrap.usage import Parser

    p = Parser(prog="swarm-bootstrap authority", description="Admit volunteers to an authenticated run.")
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="create a run authority in DIR")
    init.add_argument("dir", metavar="DIR")
    issue = sub.add_parser("issue", help="print a pass for a volunteer's request line (swarm-peer pass-request)")
    issue.add_argument("dir", metavar="DIR")
    issue.add_argument("request", metavar="REQUEST")
    issue.add_argument("--days", default=str(DEFAULT_DAYS),
                       help=f"how long the pass is valid (default {DEFAULT_DAYS:g})")
    revoke = sub.add_parser("revoke", help="revoke the passes of these peer ids")
    revoke.add_argument("dir", metavar="DIR")
    revoke.add_argument("peer_ids", metavar="PEER_ID", nargs="+")
    return p


def load_authority(directory: str | Path):
    """The authority's private key from ``DIR/authority.key``. Raises AuthorityError."""
    from peer.net.trust.auth import private_key_from_der

    path = Path(directory) / KEY
    try:
        return private_key_from_der(path.read_bytes())
    except OSError as e:
        raise AuthorityError(f"{path}: cannot read the authority key ({e.strerror}); create one with "
                             f"`swarm-bootstrap authority init {directory}`") from None
    except ValueError as e:
        raise AuthorityError(f"{path}: not an authority key ({e})") from None


def revoked_ids(directory: str | Path) -> list[str]:
    """The peer ids in ``DIR/revoked.txt`` (none if it is missing)."""
    path = Path(directory) / REVOKED
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _init(directory: Path) -> None:
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net.trust.auth import fingerprint, write_private

    if (directory / KEY).exists():
        raise AuthorityError(f"{directory / KEY} exists: an authority is already there (its passes stay valid)")
    key = RSAPrivateKey()
    write_private(directory / KEY, key.to_bytes())
    public = key.get_public_key().to_bytes().decode()
    (directory / PUB).write_text(public + "\n")
    print(f"created run authority {fingerprint(public)} in {directory} (keep {directory / KEY} secret: it admits "
          f"peers).", file=sys.stderr)
    print("Put this in the run's config (every peer's, and the bootstrap nodes get --authority "
          f"{directory}):", file=sys.stderr)
    print(f'[swarm]\nauthority = "{public}"')


def _issue(directory: Path, request: str, days: str) -> None:
    from peer.net.trust.auth import encode_pass, issue_pass, parse_pass_request

    try:
        valid_days = float(days)
    except ValueError:
        valid_days = -1.0
    if not 0 < valid_days <= 3650:
        raise AuthorityError(f"--days: {days!r} is not a number of days in (0, 3650]")
    try:
        public_key = parse_pass_request(request)
    except ValueError as e:
        raise AuthorityError(f"REQUEST: {e}") from None
    token = issue_pass(load_authority(directory), public_key, timedelta(days=valid_days))
    print(encode_pass(token))
    print(f"(a pass for peer {token.username}, valid until {token.expiration_time}; the volunteer saves the line "
          f"above as RUN_DIR/pass.txt, or where swarm.pass_path points)", file=sys.stderr)


def _revoke(directory: Path, peer_ids: Sequence[str]) -> None:
    from peer.net.trust.auth import write_private
    from peer.net.trust.records import PEER_ID

    load_authority(directory)  # (the right directory)
    bad = [p for p in peer_ids if not PEER_ID.fullmatch(p)]
    if bad:
        raise AuthorityError(f"PEER_ID: {bad[0]!r} is not a peer id")
    ids = sorted(set(revoked_ids(directory)) | set(peer_ids))
    write_private(directory / REVOKED, ("\n".join(ids) + "\n").encode())
    print(f"revoked {len(peer_ids)} peer(s), {len(ids)} in all; bootstrap nodes started with --authority "
          f"{directory} publish the list within their --refresh-period", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from bootstrap.usage import PROG, UsageError

    try:
        args = _parser().parse_args(argv)
        directory = Path(args.dir)
        if args.action == "init":
            _init(directory)
        elif args.action == "issue":
            _issue(directory, args.request, args.days)
        else:
            _revoke(directory, args.peer_ids)
    except (UsageError, AuthorityError) as e:
        print(f"{PROG} authority: error: {e}", file=sys.stderr)
        return 2
    return 0


class NodeAuthority:
    """A bootstrap node of an authenticated run: its own pass (issued at start by the authority it holds), the
    DHT options that make it serve only peers with a pass, and the revocation list it publishes."""

    SELF_PASS_DAYS = 365.0  # the node's own pass (issued anew at every start)

    def __init__(self, directory: Path, authority, dht_kwargs: dict):
        self.directory, self.authority, self.dht_kwargs = directory, authority, dht_kwargs
        self._published: Optional[list[str]] = None

    @classmethod
    def create(cls, directory: str | Path, identity_path: str) -> "NodeAuthority":
        """Must be called before the DHT starts (its options go to create_dht). Raises AuthorityError."""
        from peer.net.trust.auth import PassChecker, RunAuthorizer, identity_key, issue_pass
        from peer.net.trust.revocations import RevocationValidator
        from peer.net.plumbing.addresses import ensure_identity

        directory = Path(directory)
        authority = load_authority(directory)
        try:
            ensure_identity(identity_path)
        except ValueError as e:
            raise AuthorityError(f"--identity-path: {e}") from None
        key = identity_key(identity_path)
        token = issue_pass(authority, key.get_public_key(), timedelta(days=cls.SELF_PASS_DAYS))
        checker = PassChecker(authority.get_public_key().to_bytes())
        # (Revocations are not applied to this node's own DHT checks: a revoked peer reads the list that names it
        # through the bootstrap nodes and stops with a clear line; peers act on none of its records.)
        kwargs = {"record_validators": [RevocationValidator(checker)],
                  "authorizer": RunAuthorizer(key, token, checker)}
        return cls(directory, authority, kwargs)

    @property
    def fingerprint(self) -> str:
        from peer.net.trust.auth import fingerprint

        return fingerprint(self.authority.get_public_key().to_bytes())

    def publish(self, dht, refresh_period: float) -> None:
        """Stores the signed revocation list (if any) for 3 refresh periods; best effort (logged)."""
        import logging
        import time

        from hivemind.utils import get_dht_time

        from peer.net.trust.revocations import revocation_key, sign_revocations

        log = logging.getLogger("swarm.bootstrap")
        ids = revoked_ids(self.directory)
        if not ids:
            return
        value = sign_revocations(self.authority, ids, issued=time.time())
        key = revocation_key(self.authority.get_public_key().to_bytes())
        try:
            ok = dht.store(key, value, get_dht_time() + 3 * refresh_period, subkey=b"authority")
        except Exception as e:  # a slow DHT: the next period tries again
            log.warning(f"could not publish the revocation list: {type(e).__name__}: {e}")
            return
        if ids != self._published:
            log.info(f"published the revocation list: {len(ids)} peer(s) revoked (stored: {bool(ok)})")
            self._published = ids
