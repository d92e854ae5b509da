"""Why an initial peer cannot be reached, in the user's words: each address dialed alone.

p2pd says only "failed to connect to bootstrap peers"; a user needs to know which address failed and why
(nothing listens there, the host does not answer, or another node is there: the ``/p2p/`` part is wrong).
"""

from __future__ import annotations

import re
from typing import Sequence


def diagnose_initial_peers(initial_peers: Sequence[str], host_maddrs: Sequence[str], *, timeout: float) -> list[str]:
    """``"ADDRESS: why"`` for each initial peer: dialed one by one from a throw-away libp2p daemon (fresh per
    address, so one address's failure does not taint the next), each bounded by ``timeout`` seconds."""
    import asyncio

    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from peer.net.plumbing.hivemind_internals import connect

    # Listen like the peer would (all interfaces or the given ones) but on any port: the dial goes out from there.
    hosts = sorted({re.sub(r"/tcp/\d+", "/tcp/0", str(m)) for m in host_maddrs}) or ["/ip4/0.0.0.0/tcp/0"]

    async def dial(text: str) -> str:
        maddr = Multiaddr(text)
        peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
        p2p = await P2P.create(host_maddrs=hosts, nat_port_map=False)
        try:
            await asyncio.wait_for(connect(p2p, peer_id, [maddr.decapsulate(f"/p2p/{peer_id}")]), timeout)
            return f"{text}: answers now (it was not reachable when tried)"
        except asyncio.TimeoutError:
            return f"{text}: no answer within {timeout:g} s (host down, or a firewall drops the packets)"
        except Exception as e:
            return f"{text}: {dial_failure(str(e))}"
        finally:
            await p2p.shutdown()

    async def dial_all() -> list[str]:
        return [await dial(text) for text in initial_peers]

    try:
        return asyncio.run(dial_all())
    except Exception as e:  # the probe itself failed: still name the addresses
        return [f"{text}: unreachable ({type(e).__name__} while probing)" for text in initial_peers]


def dial_failure(message: str) -> str:
    """The reason in a libp2p "all dials failed" message, in the user's words."""
    if m := re.search(r"peer id mismatch: expected (\S+), but remote key matches (\S+)", message):
        return f"the node there has peer id {m.group(2)}, not {m.group(1)} (copy the /p2p/ part again)"
    if "connection refused" in message:
        return "connection refused (nothing listens on that port; is the bootstrap node running?)"
    if "i/o timeout" in message or "deadline" in message:
        return "no answer (host down, or a firewall drops the packets)"
    if "no route to host" in message or "network is unreachable" in message:
        return "no route to that host"
    reasons = re.findall(r"\* \[[^\]]*\] (.+)", message)
    return (reasons[0] if reasons else message.splitlines()[0]).strip()[:200]
