"""Dial-back (peer/net/plumbing/dial_back.py): which addresses a node agrees to dial, a real dial-back on loopback
(reachable, nothing listening, a third party's address refused, busy), and `swarm-peer doctor` asking a real bootstrap
node to dial back a port that does not listen (dialed back where it does: tests/test_control_swarm.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import AsyncIterator

from hivemind.p2p import P2PContext

from helpers import p2p_mesh, run_async
from peer.net.plumbing.dial_back import (DialBackServicer, ask_dial_back, ask_initial_peers, dialable, not_dialable,
                                        tcp_ip)
from peer.net.flow.streams import StreamGuard
from peer.proto import reachability_pb2 as pb
from test_swarm import REPO, start_bootstrap


def test_only_tcp_addresses_at_the_requesters_ip_are_dialed():
    assert tcp_ip("/ip4/127.0.0.1/tcp/5") == "127.0.0.1" and tcp_ip("/ip6/::1/tcp/5") == "::1"
    assert tcp_ip("/ip4/127.0.0.1/udp/5/quic") is None and tcp_ip("/ip4/nonsense/tcp/5") is None
    assert tcp_ip("/dns4/example.org/tcp/5") is None and tcp_ip("") is None
    seen = {"203.0.113.7"}
    assert dialable(["/ip4/203.0.113.7/tcp/1", "/ip4/198.51.100.1/tcp/2"], seen) == ["/ip4/203.0.113.7/tcp/1"]
    assert dialable(["/ip4/203.0.113.7/tcp/1/p2p/QmX"], seen) == []  # the requester's own id is dialed
    assert dialable([f"/ip4/203.0.113.7/tcp/{p}" for p in range(1, 10)], seen) == \
        [f"/ip4/203.0.113.7/tcp/{p}" for p in range(1, 5)]  # at most 4
    assert dialable(["/ip4/203.0.113.7/tcp/1" + "/x" * 200], seen) == []


def _closed_port() -> socket.socket:
    """A socket bound to a port of 127.0.0.1 that does not listen: connections to it are refused, and no other
    process can take the port while it is open (close it at the end)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def test_a_node_dials_back_where_the_requester_listens_and_nowhere_else():
    closed_port = _closed_port()

    async def main():
        node, requester = await p2p_mesh(2)
        try:
            servicer = DialBackServicer(guard=StreamGuard(per_peer=2, total=8), timeout=5, request_timeout=5,
                                        per_minute=2)
            await servicer.add_p2p_handlers(node)
            mine = [str(m).split("/p2p/")[0] for m in await requester.get_visible_maddrs()]
            replies = [await ask_dial_back(requester, node.peer_id, addrs, timeout=60) for addrs in
                       (mine, [f"/ip4/127.0.0.1/tcp/{closed_port.getsockname()[1]}"],
                        ["/ip4/198.51.100.1/tcp/4001"])]
            # a third dial in a minute (the refused third-party address cost none): busy
            replies.append(await ask_dial_back(requester, node.peer_id, mine, timeout=60))
            return mine, replies
        finally:
            for p in (node, requester):
                await p.shutdown()

    try:
        mine, (ok, closed, third_party, busy) = run_async(main())
    finally:
        closed_port.close()
    assert ok.reachable and ok.dialed and ok.address in mine, ok
    assert not closed.reachable and closed.dialed and "connection refused" in closed.error, closed
    assert not third_party.dialed and "IP this request came from (127.0.0.1)" in third_party.error, third_party
    assert not busy.dialed and busy.error.startswith("busy"), busy


def test_doctor_says_when_the_bootstrap_node_cannot_dial_it_back(procs, tmp_path):
    initial = start_bootstrap(procs, tmp_path)
    base = [sys.executable, "-m", "peer", "doctor", "--config", str(REPO / "configs/demo.toml"), "--initial-peers",
            *initial, "--json", "--timeout", "5"]
    # (reachable: the doctor in tests/test_control_swarm.py is dialed back by the live swarm's bootstrap node)
    # announcing a port nobody will listen on (a router that does not forward it): the doctor says so, with a fix
    with _closed_port() as port:
        closed = subprocess.run([*base, "--run-dir", str(tmp_path / "b"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                 "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{port.getsockname()[1]}"],
                                cwd=REPO, capture_output=True, text=True, timeout=180)
    report = json.loads(closed.stdout.strip().splitlines()[-1])
    check = {c["name"]: c for c in report["checks"]}["reachability"]
    assert closed.returncode == 1 and not report["ok"] and check["verdict"] == "fail", closed.stdout
    assert "could not dial this machine back" in check["found"] and "--client-mode" in check["fix"], check


def test_a_peer_of_an_authenticated_run_refuses_a_requester_without_a_pass_and_says_it_did_not_dial():
    async def main():
        node, requester = await p2p_mesh(2)
        try:
            servicer = DialBackServicer(guard=StreamGuard(per_peer=2, total=8, admitted=lambda peer: False),
                                        timeout=5, request_timeout=5)
            await servicer.add_p2p_handlers(node)
            mine = [str(m).split("/p2p/")[0] for m in await requester.get_visible_maddrs()]
            return await ask_dial_back(requester, node.peer_id, mine, timeout=60)
        finally:
            for p in (node, requester):
                await p.shutdown()

    reply = run_async(main())
    assert not reply.dialed and not reply.reachable and "valid pass" in reply.error, reply


def test_a_peer_is_judged_behind_a_nat_when_a_dial_failed_or_the_swarm_sees_it_elsewhere():
    mine = ["/ip4/192.168.4.2/tcp/4001"]
    assert not_dialable(None, mine) is None  # nobody could tell
    assert not_dialable(pb.DialBackReply(reachable=True, dialed=True, address=mine[0]), mine) is None
    failed = not_dialable(pb.DialBackReply(dialed=True, error="connection refused"), mine)
    assert failed and "connection refused" in failed
    seen = not_dialable(pb.DialBackReply(error="none of the addresses ...", observed_ip="10.77.0.4"), mine)
    assert seen and "10.77.0.4" in seen and "192.168.4.2" in seen and "NAT" in seen
    # busy, or refused, at our own IP: says nothing
    assert not_dialable(pb.DialBackReply(error="busy: try again in a minute", observed_ip="192.168.4.2"), mine) is None


class _DropsFirst(DialBackServicer):
    """A node whose first dial-back exchange ends with no reply (the stream closes), as may happen right after a
    peer joined; it answers the next one."""

    calls = 0

    async def rpc_dial_back(self, requests: AsyncIterator[pb.DialBackRequest],
                            context: P2PContext) -> AsyncIterator[pb.DialBackReply]:
        type(self).calls += 1
        if type(self).calls == 1:
            return
        async for reply in super().rpc_dial_back(requests, context):
            yield reply


_DropsFirst.__name__ = "DialBackServicer"  # (hivemind names a handler's protocol after its class)


def test_an_exchange_that_ends_without_a_reply_is_asked_once_more():
    async def main():
        node, requester = await p2p_mesh(2)
        try:
            servicer = _DropsFirst(guard=StreamGuard(per_peer=2, total=8), timeout=5, request_timeout=5)
            await servicer.add_p2p_handlers(node)
            mine = [str(m).split("/p2p/")[0] for m in await requester.get_visible_maddrs()]
            initial = [f"{m}/p2p/{node.peer_id}" for m in [str(a).split("/p2p/")[0]
                                                          for a in await node.get_visible_maddrs()]][:1]
            return mine, await ask_initial_peers(requester, initial, mine, timeout=5)
        finally:
            for p in (node, requester):
                await p.shutdown()

    mine, reply = run_async(main())
    assert _DropsFirst.calls == 2
    assert reply is not None and reply.dialed and reply.reachable and reply.address in mine, reply
