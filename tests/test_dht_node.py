"""peer/net/plumbing/addresses.py and dht.py: identities, multiaddr checks, network-safety options, addresses."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import dht_nodes
from peer.net.plumbing import addresses, dht as dht_node

GOOD_PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def test_ensure_identity_creates_then_reuses(tmp_path):
    path = tmp_path / "deep" / "er" / "node.id"
    peer_id = addresses.ensure_identity(path)
    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert peer_id.startswith("Qm") and len(peer_id) > 40  # base58 of an RSA key's multihash
    assert [p.name for p in path.parent.iterdir()] == ["node.id"]  # no temp file left behind
    assert addresses.ensure_identity(str(path)) == peer_id  # same file, same peer id


def test_ensure_identity_matches_hivemind_format(tmp_path):
    from hivemind.p2p import P2P, PeerID

    ours = tmp_path / "ours.id"
    peer_id = addresses.ensure_identity(ours)
    assert PeerID.from_identity(ours.read_bytes()).to_base58() == peer_id
    theirs = tmp_path / "theirs.id"
    P2P.generate_identity(str(theirs))  # a key file hivemind wrote itself is accepted as-is
    assert addresses.ensure_identity(theirs) == PeerID.from_identity(theirs.read_bytes()).to_base58()


@pytest.mark.parametrize("content", [b"", b"not a key at all", b"\x08\x00\x12\x05hello"])
def test_ensure_identity_rejects_corrupt_file(tmp_path, content):
    path = tmp_path / "bad.id"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.id.*not a valid libp2p private key"):
        addresses.ensure_identity(path)
    assert path.read_bytes() == content  # never overwritten


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(initial_peers=["xyz"]),
         r"^--initial-peers: 'xyz' is not a multiaddr \(expected /ip4/HOST/tcp/PORT/p2p/PEER_ID\)$"),
        (dict(initial_peers=["/ip4/127.0.0.1/tcp/1"]),
         r"^--initial-peers: '/ip4/127.0.0.1/tcp/1' has no /p2p/PEER_ID part"),
        (dict(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmXyz"]), r"^--initial-peers: .* is not a multiaddr"),
        (dict(host_maddrs=["foo"]), r"^--host-maddrs: 'foo' is not a multiaddr \(expected /ip4/HOST/tcp/PORT\)$"),
        (dict(host_maddrs=["/ip4/127.0.0.1/tcp/http"]), r"^--host-maddrs: .* is not a multiaddr"),
        (dict(host_maddrs=[]), r"^--host-maddrs: at least one address is required"),
        (dict(host_maddrs=[GOOD_PEER]), r"^--host-maddrs: .* must not contain /p2p/"),
        (dict(announce_maddrs=["/ip4/300.1.1.1/tcp/1"]), r"^--announce-maddrs: .* is not a multiaddr"),
        (dict(announce_maddrs=["/ip4/127.0.0.1/tcp/0"]), r"^--announce-maddrs: .* needs an explicit port"),
        (dict(relay_via=["/ip4/127.0.0.1/tcp/1"]), r"^--relay-via: '/ip4/127.0.0.1/tcp/1' has no /p2p/PEER_ID part"),
        (dict(relay_via=[GOOD_PEER], client_mode=True), r"^--relay-via: not with --client-mode"),
        (dict(relay_via=[GOOD_PEER], relay_service=True), r"^--relay-via: .* cannot relay for others"),
    ],
)
def test_create_dht_rejects_bad_multiaddrs(tmp_path, kwargs, message):
    args = dict(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                identity_path=str(tmp_path / "x.id"), client_mode=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message) as info:
        dht_node.create_dht(**args)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "x.id").exists()  # validation happens before anything is created


def test_create_dht_rejects_corrupt_identity(tmp_path):
    (tmp_path / "x.id").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"^--identity-path: .*x.id"):
        dht_node.create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                            identity_path=str(tmp_path / "x.id"), client_mode=False)


class _FakeDHT:
    """Stands in for hivemind.DHT to see exactly what create_dht passes (nothing is started)."""

    calls: list = []

    def __init__(self, initial_peers=None, **kwargs):
        self.kwargs = dict(kwargs, initial_peers=initial_peers)
        _FakeDHT.calls.append(self.kwargs)

    def run_in_background(self, await_ready=True, timeout=None):
        assert await_ready and timeout is not None and timeout > 0


def test_create_dht_network_safety_options(monkeypatch, tmp_path):
    import hivemind

    monkeypatch.setattr(hivemind, "DHT", _FakeDHT)
    _FakeDHT.calls.clear()
    dht_node.create_dht(initial_peers=[GOOD_PEER], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                        identity_path=str(tmp_path / "x.id"), client_mode=True)
    (kw,) = _FakeDHT.calls
    assert kw["nat_port_map"] is False
    assert kw["check_if_identity_free"] is False  # the check would spawn a P2P with nat_port_map=True
    assert kw["use_ipfs"] is False
    assert kw["start"] is False and kw["client_mode"] is True
    assert kw["initial_peers"] == [GOOD_PEER] and kw["announce_maddrs"] is None
    assert kw["identity_path"] == str(tmp_path / "x.id") and (tmp_path / "x.id").is_file()
    dht_node.create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                        identity_path=None, client_mode=False, nat_port_map=True)
    assert _FakeDHT.calls[-1]["nat_port_map"] is True and _FakeDHT.calls[-1]["initial_peers"] is None
    with pytest.raises(TypeError, match="check_if_identity_free"):
        dht_node.create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                            identity_path=None, client_mode=False, check_if_identity_free=True)


def test_create_dht_relay_options(monkeypatch, tmp_path):
    """relay_via: static relays (p2pd flags -autoRelay -trustedRelays -forceReachabilityPrivate -relayDiscovery=0);
    relay_service: reachability public (p2pd's configured relay service), GOMAXPROCS=1 for p2pd; neither: hivemind's
    defaults."""
    import hivemind
    from hivemind.p2p import P2P

    monkeypatch.setattr(hivemind, "DHT", _FakeDHT)
    monkeypatch.setattr(P2P, "FORCE_REACHABILITY_MAPPING", dict(P2P.FORCE_REACHABILITY_MAPPING))
    _FakeDHT.calls.clear()
    base = dict(initial_peers=[GOOD_PEER], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                identity_path=None, client_mode=False)
    dht_node.create_dht(**base)
    assert not {"use_auto_relay", "trusted_relays", "force_reachability"} & set(_FakeDHT.calls[-1])
    monkeypatch.setenv("GOMAXPROCS", "4")  # (restored after the test)
    dht_node._register_relay_modes(_FakeDHT.calls[-1])  # (what the DHT process does before P2P.create)
    assert os.environ["GOMAXPROCS"] == "4"
    dht_node.create_dht(**base, relay_service=True)
    kw = _FakeDHT.calls[-1]
    assert P2P._make_process_args(**P2P.FORCE_REACHABILITY_MAPPING[kw["force_reachability"]]) == [
        "-forceReachabilityPublic=1"]
    dht_node._register_relay_modes(kw)
    assert os.environ["GOMAXPROCS"] == "1"  # a relay's p2pd: see dht_node.RELAY_SERVICE
    dht_node.create_dht(**base, relay_via=[GOOD_PEER])
    kw = _FakeDHT.calls[-1]
    assert kw["use_auto_relay"] is True and kw["trusted_relays"] == [GOOD_PEER]
    flags = P2P._make_process_args(**P2P.FORCE_REACHABILITY_MAPPING[kw["force_reachability"]])
    assert sorted(flags) == ["-forceReachabilityPrivate=1", "-relayDiscovery=0"]
    with pytest.raises(TypeError, match="trusted_relays"):
        dht_node.create_dht(**base, trusted_relays=[GOOD_PEER])


def test_visible_maddrs_drops_unspecified_hosts():
    from hivemind.utils.multiaddr import Multiaddr

    pid = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
    addrs = [f"/ip4/0.0.0.0/tcp/5/p2p/{pid}", f"/ip4/127.0.0.1/tcp/5/p2p/{pid}", f"/ip6/::/tcp/5/p2p/{pid}",
             f"/ip6/::1/tcp/5/p2p/{pid}", f"/ip4/127.0.0.1/tcp/5/p2p/{pid}"]

    class Fake:
        def get_visible_maddrs(self, latest=False):
            return [Multiaddr(a) for a in addrs]

    assert dht_node.visible_maddrs(Fake()) == [f"/ip4/127.0.0.1/tcp/5/p2p/{pid}", f"/ip6/::1/tcp/5/p2p/{pid}"]
    assert dht_node.paste_line(Fake()) == (
        f"--initial-peers /ip4/127.0.0.1/tcp/5/p2p/{pid} /ip6/::1/tcp/5/p2p/{pid}")


def test_real_dht_on_loopback(tmp_path):
    from hivemind.utils.multiaddr import Multiaddr

    peer_id = addresses.ensure_identity(tmp_path / "node.id")
    dht = dht_node.create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                              identity_path=str(tmp_path / "node.id"), client_mode=False, startup_timeout=20)
    try:
        assert dht.peer_id.to_base58() == peer_id
        maddrs = dht_node.visible_maddrs(dht)
        assert maddrs
        assert all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{peer_id}") for m in maddrs)
        assert all(Multiaddr(m)["tcp"] != "0" for m in maddrs)
        assert dht_node.paste_line(dht) == "--initial-peers " + " ".join(maddrs)
        assert dht_node.peer_counts(dht) == (0, 0)
        children = dht_node._children(dht.pid)
        assert children, "expected a p2pd child of the DHT process"
    finally:
        dht_node.shutdown_dht(dht)
    assert not dht.is_alive()
    assert not [c for c in children if dht_node._alive(*c)]


def test_bootstrap_cli_import_is_light():
    """`swarm-bootstrap --help` must not pay for importing hivemind (and torch)."""
    code = "import sys, bootstrap.cli; bad = {'torch', 'hivemind'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


HAMMER = """
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import hivemind
from peer.net.plumbing import dht as dht_node
hits = []
signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))  # a Python-level handler: read() gets EINTR
hammer = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\\n"
    "deadline = time.monotonic() + 30\\n"
    "while time.monotonic() < deadline:\\n"
    "    try: os.kill(int(sys.argv[1]), signal.SIGUSR1)\\n"
    "    except ProcessLookupError: break\\n", str(os.getpid())])
try:
    deadline = time.monotonic() + 20
    while not hits and time.monotonic() < deadline:  # the signal storm has begun
        time.sleep(0.01)
    assert hits, "no SIGUSR1 arrived"
    with dht_node._handled_signals_deferred():
        hivemind.utils.MPFuture()  # first shared tensor of the process: libshm starts torch_shm_manager
finally:
    hammer.kill()
    hammer.wait()
print("ok")
"""


def test_signals_during_torch_shm_manager_start_do_not_hang():
    """Regression: a signal caught by a Python handler while libshm starts torch_shm_manager made the
    process spin forever (retry-on-EINTR of a stored read() result); create_dht defers such signals."""
    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", HAMMER, root], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


async def _isolate(_dht, node) -> int:
    """Fault injection (in the DHT process): forget every neighbour and hang up on every connection, as a
    node does after its link was down long enough that every request to its neighbours failed."""
    table = node.protocol.routing_table
    for bucket in table.buckets:
        for node_id in list(bucket.nodes_to_peer_id):
            del table[node_id]
    for info in await node.p2p.list_peers():
        await node.p2p._client.disconnect(info.peer_id)
    return sum(len(bucket.nodes_to_peer_id) for bucket in table.buckets)


@pytest.mark.timeout(120)
def test_reconnect_brings_an_isolated_node_back(tmp_path):
    """A node that knows no one (and no one knows it) is back in both routing tables after one reconnect;
    peers already in its table are not pinged again."""
    with dht_nodes(2, tmp_path) as nodes:
        first, second = nodes
        assert dht_node.peer_counts(second)[0] == 1
        for node in nodes:
            assert node.run_coroutine(_isolate, return_future=True).result(timeout=30) == 0
        assert dht_node.peer_counts(second) == (0, 0) and dht_node.peer_counts(first)[0] == 0
        peers = addresses.peers_of(dht_node.visible_maddrs(first))
        assert list(peers) == [str(first.peer_id)]
        assert dht_node.reconnect(second, peers, timeout=3.0).result(timeout=30) == 1
        assert dht_node.peer_counts(first)[0] == 1  # the answer put us in its table too
        assert dht_node.reconnect(second, peers, timeout=3.0).result(timeout=30) == 1  # nothing missing: no-op


def test_a_dht_that_never_becomes_ready_says_where_it_hung(tmp_path, monkeypatch, capfd):
    """A DHT process whose start hangs (here, before its node exists) prints every thread's stack to the stderr it
    shares with us once create_dht gives up on it, then is shut down: the log says where the start hung."""
    import hivemind

    def _stuck_before_the_node_exists(self) -> None:
        time.sleep(300)

    monkeypatch.setattr(hivemind.DHT, "run", _stuck_before_the_node_exists)  # (the forked process inherits it)
    with pytest.raises(RuntimeError, match=r"^DHT did not become ready within \d+ s"):
        dht_node.create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                            identity_path=str(tmp_path / "x.id"), client_mode=False, startup_timeout=0.5,
                            wait_timeout=0.5)
    err = capfd.readouterr().err
    assert "_stuck_before_the_node_exists" in err and "thread 0x" in err, err[-2000:]
