"""Who a node is and where it listens, checked before any DHT starts: the libp2p identity file (:func:`ensure_identity`)
and the multiaddr lists a user passes (:func:`check_maddrs`: each error names its flag), for the peer daemon and the
bootstrap node alike. hivemind is imported lazily (it imports torch).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

_PEER_FORMAT = "/ip4/HOST/tcp/PORT/p2p/PEER_ID"
_HOST_FORMAT = "/ip4/HOST/tcp/PORT"


def _peer_id_of(data: bytes) -> str:
    from hivemind.p2p import PeerID

    return PeerID.from_identity(data).to_base58()


def ensure_identity(path: str | Path) -> str:
    """Create (if missing) or validate the libp2p RSA identity at ``path``; return its peer id (base58).

    The file uses hivemind's own format (a ``crypto_pb2.PrivateKey`` protobuf wrapping a DER RSA key, as
    ``P2P.generate_identity`` writes), so p2pd accepts it and the peer id is stable across restarts.
    Creation is atomic: temp file in the same folder, fsync, chmod 0400, then link/rename into place.
    """
    path = Path(path)
    if not path.exists():
        from hivemind.proto import crypto_pb2
        from hivemind.utils.crypto import RSAPrivateKey

        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        blob = blob.SerializeToString()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o400)
            try:
                os.link(tmp, path)  # never clobbers an identity another process created meanwhile
            except FileExistsError:
                pass
            except OSError:  # filesystem without hard links
                os.rename(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read identity file {str(path)!r}: {e}") from e
    try:
        return _peer_id_of(data)
    except Exception as e:  # protobuf DecodeError, DER ValueError from cryptography, ...
        raise ValueError(
            f"identity file {str(path)!r} is not a valid libp2p private key ({type(e).__name__}: {e}); "
            f"move it away to generate a new identity (this changes the peer id)"
        ) from e


def _check_maddrs(flag: str, maddrs: Iterable[str], *, need_peer: bool, explicit_port: bool = False) -> list[str]:
    from hivemind.utils.multiaddr import Multiaddr

    expected = _PEER_FORMAT if need_peer else _HOST_FORMAT
    out = []
    for item in maddrs:
        text = str(item)
        try:
            maddr = Multiaddr(text)
            names = [p.name for p in maddr.protocols()]
        except Exception:
            raise ValueError(f"{flag}: {text!r} is not a multiaddr (expected {expected})") from None
        if need_peer and "p2p" not in names:
            raise ValueError(f"{flag}: {text!r} has no /p2p/PEER_ID part (expected {expected})")
        if not need_peer and "p2p" in names:
            raise ValueError(f"{flag}: {text!r} must not contain /p2p/ (expected {expected})")
        if explicit_port and any(maddr.value_for_protocol(p) == "0" for p in ("tcp", "udp") if p in names):
            raise ValueError(f"{flag}: {text!r} needs an explicit port, not 0")
        out.append(text)
    return out


def check_maddrs(
    *, initial_peers: Iterable[str], host_maddrs: Iterable[str], announce_maddrs: Iterable[str]
) -> tuple[list[str], list[str], list[str]]:
    """Validate the three address lists (as ``create_dht`` does first); ``ValueError`` names the flag."""
    initial_peers = _check_maddrs("--initial-peers", initial_peers, need_peer=True)
    host_maddrs = _check_maddrs("--host-maddrs", host_maddrs, need_peer=False)
    announce_maddrs = _check_maddrs("--announce-maddrs", announce_maddrs, need_peer=False, explicit_port=True)
    if not host_maddrs:
        raise ValueError(f"--host-maddrs: at least one address is required (expected {_HOST_FORMAT})")
    return initial_peers, host_maddrs, announce_maddrs


def peers_of(maddrs: Iterable[str]) -> dict[str, list[str]]:
    """{peer id: its multiaddrs} of ``/.../p2p/PEER_ID`` addresses (as checked by ``check_maddrs``)."""
    from hivemind.utils.multiaddr import Multiaddr

    out: dict[str, list[str]] = {}
    for text in maddrs:
        out.setdefault(Multiaddr(str(text)).value_for_protocol("p2p"), []).append(str(text))
    return out
