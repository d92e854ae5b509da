"""Peers behind home routers (NAT, no port forward) in a real swarm across network namespaces.

A bootstrap node in host 0, two peers in hosts 1-2 with public lab addresses, and peers 3 and 4 in hosts 3-4,
each behind a home router of its own (:class:`netns.NetnsLab` ``nat=[3, 4]``: iptables masquerade, replies only).
Peer 3 runs in client mode, as the README tells a volunteer behind a NAT to; peer 4 finds at start that it must.
Both dial out only, reduce no span, and serve no state. What must hold: nobody can dial them (checked on their
real ports), and yet their outer gradients are in every average they take part in (every span of their rounds
lists four contributors), with one digest across the four.

Relayed reducers: peers 2 and 3 both behind home routers, *not* in client mode, dialable only through the bootstrap
node (``swarm-bootstrap --relay-service``, ``--relay-via`` on their side: libp2p circuit relay). Each reduces a span
that holds the other's part, and their routers never forwarded a packet between the two: that part crossed the
relay.

Skipped (with the reason) where network namespaces or iptables NAT cannot be set up here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import assert_one_digest_per_applied_round, events, wait_for
from netns import PUBLIC_SUBNET, NetnsLab, nat_available, start_lab_swarm
from test_netns_swarm import FAST

pytestmark = pytest.mark.swarm

MAX_STEPS = 60  # fragment 0 launches at 20 and 40, fragment 1 at 30 and 50 (H = 20, tau = 10)
NAMES = ["p1", "p2", "p3", "p4"]
CLIENT, FINDS = 3, 4  # hosts (and peers p3, p4) behind home routers: in client mode, and finding out at start


@pytest.fixture
def lab():
    ok, reason = nat_available()
    if not ok:
        pytest.skip(reason)
    with NetnsLab(5, nat=[CLIENT, FINDS]) as lab:
        yield lab
    assert not lab.namespaces(), f"namespaces left behind: {lab.namespaces()}"


def dial(lab: NetnsLab, host: int, addr: str, port: int) -> str:
    """Tries a TCP connection from ``host`` to ``addr:port`` (3 s at most); returns "connected" or the error."""
    code = (f"import socket\ntry:\n socket.create_connection(({addr!r}, {port}), timeout=3); print('connected')\n"
            f"except OSError as e:\n print(type(e).__name__)")
    return subprocess.run(lab.run_args(host, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=30).stdout.strip()


def finished_rounds(peers: dict, tmp_path) -> tuple[dict, list]:
    """Waits for every peer to exit 0; returns each one's round events by (fragment, round) and the rounds all
    of them completed ok."""
    for name, proc in peers.items():
        wait_for(lambda: proc.returncode is not None, 180, f"{name} to exit:\n{proc.tail()}")
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.tail()}"
    names = list(peers)
    assert_one_digest_per_applied_round(tmp_path, names)  # every round, no filter
    rounds = {n: {(e["fragment"], e["round"]): e for e in events(tmp_path, n, "round")} for n in names}
    together = sorted(set.intersection(*(set(k for k, e in rounds[n].items() if e["status"] == "ok")
                                         for n in names)))
    return rounds, together


def test_peers_behind_nat_in_client_mode_are_in_every_average(lab, procs, tmp_path):
    """p3 runs with --client-mode. p4 does not, and finds out at start that the swarm sees it at its router's
    address, none of its own (swarm.reachability_check), then goes on in client mode and says so in one line."""
    public = ["--max-steps", str(MAX_STEPS), *FAST]
    finds = [*public, "--reachability-check"]  # (the lab turns it off)
    boot, _, peers = start_lab_swarm(lab, procs, tmp_path, [public, public, [*public, "--client-mode"], finds])
    assert list(peers) == NAMES
    line = peers["p4"].wait_for_line(r"nobody outside can dial this peer: (.*)", timeout=60)
    assert lab.public_addr(FINDS) in line.group(1), line.group(0)
    assert not events(tmp_path, "p4", "round"), "the check must answer before the first round"

    # each listens on its private address; from outside neither that address nor its router's port answers
    for host in (CLIENT, FINDS):
        start = wait_for(lambda: events(tmp_path, f"p{host}", "start"), 90, f"p{host}'s start event")[0]
        assert all(m.startswith(f"/ip4/{lab.addr(host)}/") for m in start["maddrs"]), start["maddrs"]
        port = int(start["maddrs"][0].split("/tcp/")[1].split("/")[0])
        assert dial(lab, host, lab.addr(host), port) == "connected"  # it does listen
        for addr in (lab.addr(host), lab.public_addr(host)):
            assert dial(lab, 1, addr, port) != "connected", f"{addr}:{port} answered from outside the NAT"

    rounds, together = finished_rounds(peers, tmp_path)
    # every round of the run but at most one (e.g. a slow start) averaged the four, p3's and p4's parts in every
    # span
    assert len(together) >= 3, {n: {k: e["status"] for k, e in r.items()} for n, r in rounds.items()}
    for key in together:
        got = [rounds[n][key] for n in NAMES]
        assert all(e["group_size"] == 4 and e["spans_missing"] == 0 for e in got), got
        assert all(len(span) == 4 for span in got[0]["contributors"] if span), got[0]["contributors"]
        assert len([span for span in got[0]["contributors"] if span]) == 2  # p1 and p2 reduce; p3, p4 none
        assert len({e["digest"] for e in got}) == 1, f"{key}: digests differ"
    assert boot.terminate(timeout=30) == 0


RELAY_STEPS = MAX_STEPS  # four rounds; at least two must average all three (a peer may start a round late)
RELAYED = (2, 3)  # hosts (and peers p2, p3) behind home routers, dialed through the bootstrap node


@pytest.fixture
def relay_lab():
    ok, reason = nat_available()
    if not ok:
        pytest.skip(reason)
    # public-looking lab addresses: libp2p advertises no circuit address through a relay at a private one
    with NetnsLab(4, nat=RELAYED, subnet=PUBLIC_SUBNET) as lab:
        yield lab
    assert not lab.namespaces(), f"namespaces left behind: {lab.namespaces()}"


def test_two_peers_behind_nat_reduce_spans_through_a_relay(relay_lab, procs, tmp_path):
    """p2 and p3 (behind NAT, not in client mode, --relay-via the bootstrap node) and p1 (public): in every round
    of all three (at least two of four), each reduces a span holding all three parts, one digest; p2's and p3's
    routers forwarded nothing between them, so each one's part reached the other through the relay."""
    lab = relay_lab
    a, b = RELAYED
    lab.count_packets(a, lab.public_addr(b))
    lab.count_packets(b, lab.public_addr(a))
    lab.count_packets(a, lab.addr(0))  # (the counters do count: p2 talks to the bootstrap node)
    # fp32 parts (~0.8 MB per span): far beyond the 128 KiB a relayed connection may carry under libp2p's default
    # relay limits, which a relay without --relay-service can end up serving with (docs/architecture.md)
    flags = ["--max-steps", str(RELAY_STEPS), *FAST, "--outer-codec", "fp32"]
    relayed = lambda initial: [*flags, "--relay-via", *initial]  # noqa: E731
    boot, _, peers = start_lab_swarm(lab, procs, tmp_path, [flags, relayed, relayed], boot_args=["--relay-service"])

    rounds, together = finished_rounds(peers, tmp_path)
    assert len(together) >= 2, {n: {k: e["status"] for k, e in r.items()} for n, r in rounds.items()}
    for key in together:
        got = [rounds[n][key] for n in peers]
        assert all(e["group_size"] == 3 and e["spans_missing"] == 0 for e in got), got
        spans = [span for span in got[0]["contributors"] if span]
        assert len(spans) == 3 and all(len(span) == 3 for span in spans), got[0]["contributors"]  # all reduce
        assert len({e["digest"] for e in got}) == 1, f"{key}: digests differ"
    direct = {f"p{a}<->p{b}": lab.packets(a, lab.public_addr(b)), f"p{b}<->p{a}": lab.packets(b, lab.public_addr(a))}
    assert not any(direct.values()), f"packets forwarded directly between the NAT'd peers: {direct}"
    assert lab.packets(a, lab.addr(0)) > 0
    assert boot.terminate(timeout=30) == 0
